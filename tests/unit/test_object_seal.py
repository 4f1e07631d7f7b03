"""Seals (``controllers.object_seal``) and disk slots (``cache_actors.node.disk_tier``):
a seal verifies only the page, key, length and seal key it was made for; the seal key
file is made private once and read back the same, and refused when others may read it
or it holds no key; two live claims of one disk directory never share a slot."""

import os
import stat

import pytest
from raykv.cache_actors.node.disk_tier import BUCKET_BYTES, DiskSlot
from raykv.controllers.object_seal import (
    KEY_BYTES,
    MAGIC,
    SEAL_BYTES,
    SEAL_KEY_FILE,
    check,
    check_seal_key,
    read_seal_key,
    seal,
)

KEY = bytes(range(KEY_BYTES))
OTHER_KEY = bytes(reversed(range(KEY_BYTES)))
PAGE = bytes((i * 7 + 3) % 256 for i in range(4096))


def test_a_seal_verifies_its_own_page_and_nothing_else():
    sealed = seal(KEY, "tenant/page-1", PAGE)
    assert len(sealed) == SEAL_BYTES and sealed.startswith(MAGIC)
    assert check(KEY, "tenant/page-1", PAGE, sealed) is None
    assert check(KEY, "tenant/page-1", memoryview(PAGE), sealed) is None  # views too
    flipped = bytearray(PAGE)
    flipped[len(PAGE) // 2] ^= 0x01
    assert check(KEY, "tenant/page-1", bytes(flipped), sealed) == "mac"
    assert check(KEY, "tenant/page-2", PAGE, sealed) == "mac"  # another object's key
    assert check(OTHER_KEY, "tenant/page-1", PAGE, sealed) == "mac"  # another cluster
    assert check(KEY, "tenant/page-1", PAGE[:-1], sealed) == "length"  # truncated page
    assert check(KEY, "tenant/page-1", PAGE + b"\0", sealed) == "length"
    assert check(KEY, "tenant/page-1", PAGE, sealed[:-1]) == "format"  # truncated seal
    assert check(KEY, "tenant/page-1", PAGE, b"\0" * SEAL_BYTES) == "format"  # no seal
    # a seal made under another cluster's key, for the very same page and object key
    assert check(KEY, "tenant/page-1", PAGE, seal(OTHER_KEY, "tenant/page-1", PAGE)) == "mac"
    # a flipped bit in the seal's MAC is caught too
    bad_mac = bytearray(sealed)
    bad_mac[-1] ^= 0x80
    assert check(KEY, "tenant/page-1", PAGE, bytes(bad_mac)) == "mac"


def test_the_key_and_length_cannot_be_shifted_into_each_other():
    """The MAC covers the key's length: key ``a`` with page ``b...`` is not key ``ab``
    with the rest of the page."""
    page = b"b" + PAGE
    assert check(KEY, "ab", PAGE, seal(KEY, "a", page)) == "length"
    assert seal(KEY, "a", page)[len(MAGIC) + 8:] != seal(KEY, "ab", PAGE)[len(MAGIC) + 8:]


def test_the_seal_key_file_is_made_private_once_and_read_back_the_same(tmp_path):
    directory = tmp_path / "disk"  # absent: made
    key = read_seal_key(directory)
    assert len(check_seal_key(key)) == KEY_BYTES
    path = directory / SEAL_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_seal_key(directory) == key  # read again, not made anew
    # CONTROL: another directory gets another key
    assert read_seal_key(tmp_path / "other") != key


def test_a_seal_key_file_others_may_read_is_refused(tmp_path):
    read_seal_key(tmp_path)
    path = tmp_path / SEAL_KEY_FILE
    for mode in (0o640, 0o604, 0o620):
        os.chmod(path, mode)
        with pytest.raises(ValueError, match="chmod 600"):
            read_seal_key(tmp_path)
    os.chmod(path, 0o600)  # CONTROL: private again, read as before
    assert len(check_seal_key(read_seal_key(tmp_path))) == KEY_BYTES


@pytest.mark.parametrize("text", ["", "not hex at all", "ab" * (KEY_BYTES - 1),
                                  "ab" * (KEY_BYTES + 1), "zz" * KEY_BYTES])
def test_a_seal_key_file_without_a_key_is_refused(tmp_path, text):
    path = tmp_path / SEAL_KEY_FILE
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="64 hex digits"):
        read_seal_key(tmp_path)
    assert path.read_text() == text  # left as it was
    path.write_text("ab" * KEY_BYTES + "\n")  # CONTROL: a key is read
    assert read_seal_key(tmp_path) == "ab" * KEY_BYTES


def test_live_claims_of_one_directory_get_distinct_slots_and_a_released_one_is_reused(
        tmp_path):
    """Two claims (two open lock files: ``flock`` locks per open file, so this holds
    within one process as across processes) get ``node-0`` and ``node-1``; once the
    first is released, the next claim gets ``node-0`` again."""
    first = DiskSlot.claim(str(tmp_path), 3 * BUCKET_BYTES)
    second = DiskSlot.claim(str(tmp_path), 3 * BUCKET_BYTES)
    try:
        assert (first.path.name, second.path.name) == ("node-0", "node-1")
        assert stat.S_IMODE(first.path.stat().st_mode) == 0o700
        assert first.environment()["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] == str(first.path)
        (second.path / "a.bucket").write_bytes(b"x" * 100)
        assert (first.used_bytes(), second.used_bytes()) == (0, 100)
        first.release()
        again = DiskSlot.claim(str(tmp_path), 3 * BUCKET_BYTES)  # empty: no wait
        assert again.path == first.path and again.waited_s == 0
        again.release()
    finally:
        first.release()
        second.release()


@pytest.mark.parametrize("limit", [0, -1, 1 << 20, 3 * BUCKET_BYTES - 1])
def test_a_slot_without_room_for_three_buckets_is_refused_before_anything_is_made(
        tmp_path, limit):
    """Mooncake stalls every put once a slot with room for fewer than three buckets
    holds one (``disk_tier.MIN_SLOT_BYTES``): such a bound is refused up front."""
    with pytest.raises(ValueError, match="three offload buckets"):
        DiskSlot.claim(str(tmp_path / "disk"), limit)
    assert not (tmp_path / "disk").exists()
    DiskSlot.claim(str(tmp_path / "disk"), 3 * BUCKET_BYTES).release()  # CONTROL
