"""Owner keys, challenges, owner sessions and call proofs (``controllers.owner_keys``,
``controllers.owner_sessions``), and the controller's registration proofs: what is seen
on the wire once cannot be shown again. Each replay test has its control: the old
design's static owner proof (HMAC of a fixed label under the secret, as raykv sent it
on every call before owner sessions) replays successfully against the old check."""

from __future__ import annotations

import copy
import hashlib
import hmac
import pickle
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.controllers.contract import StorageConfig
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.owner_keys import (
    SESSION,
    OwnerKey,
    RankSession,
    answer_challenge,
    fresh_nonce,
    prove_registration,
    signature_valid,
    transcript,
)
from raykv.controllers.owner_sessions import (
    CallWindow,
    Challenges,
    OwnerSessions,
    UnknownSessionError,
)
from raykv.controllers.ownership import (
    OwnerBindings,
    claim_of,
    tenant_digest,
    verify_registration,
)

from tests.unit.test_owner_bindings import SECRET_A, SECRET_B, Ranks

CONFIG = StorageConfig(model_name="m", extra_config={"tenant": "team-a"})
CLAIM = claim_of(CONFIG)
ENV = {"RAYKV_TENANT_SECRET": SECRET_A.decode()}


def old_static_proof(secret: bytes) -> str:
    """What a rank sent on every call before owner sessions (the old ``owner_proof``)."""
    return hmac.new(secret, b"raykv/owner/v1", hashlib.sha256).hexdigest()


def old_check(bound_digest: str, proof: str) -> bool:
    """What a node actor checked before owner sessions: the proof's SHA-256."""
    return hashlib.sha256(proof.encode()).hexdigest() == bound_digest


def test_control_the_old_static_proof_replays_for_ever():
    proof = old_static_proof(SECRET_A)
    bound = hashlib.sha256(proof.encode()).hexdigest()
    seen = proof  # whoever saw one call
    assert old_check(bound, seen) and old_check(bound, seen)  # accepted again and again


def test_a_call_proof_is_accepted_once():
    bindings = OwnerBindings()
    ranks = Ranks(bindings)
    seen = ranks("a")
    assert bindings.verify(seen) is seen
    with pytest.raises(ValueError, match="shown before"):
        bindings.verify(seen)  # the same proof from another process: a replay
    assert bindings.verify(ranks("a")) is not None  # control: the rank's next proof


def test_a_captured_session_answer_opens_nothing_again():
    bindings = OwnerBindings()
    key = OwnerKey.of_secret(SECRET_A)
    request, _ = answer_challenge(key, bindings.challenge(), CLAIM.deployment_id,
                                  "team-a", CLAIM.key_prefix)
    assert bindings.open_session(CLAIM, request)  # control: the rank's own answer opens
    with pytest.raises(ValueError, match="challenge is unknown, answered already"):
        bindings.open_session(CLAIM, request)  # sent again by whoever saw it
    fresh = bindings.challenge()  # a new challenge does not take an old signature
    with pytest.raises(ValueError, match="signature does not verify"):
        bindings.open_session(CLAIM, replace(request, nonce=fresh.nonce))


def test_a_session_is_useless_without_its_key():
    bindings = OwnerBindings()
    ranks = Ranks(bindings)
    seen = ranks("a")  # an observer has the session id and a call number
    session_id, number, tag = seen.proof.split(".")
    forged = f"{session_id}.{int(number) + 1}.{'0' * 32}"
    with pytest.raises(ValueError, match="does not verify"):
        bindings.verify(replace(seen, proof=forged))
    other = RankSession(session_id, b"k" * 32)  # a guessed session key
    with pytest.raises(ValueError, match="does not verify"):
        bindings.verify(replace(seen, proof=other.call_proof("")))
    assert bindings.verify(seen) is seen  # control: the rank's own proof


def old_call_tag(key: bytes, session_id: str, number: int) -> str:
    """A call proof's tag before it covered the call: session id and number only."""
    return hmac.new(key, f"{session_id}.{number}".encode(), hashlib.sha256).hexdigest()[:32]


def test_a_call_proof_is_good_for_its_own_method_and_arguments_only():
    """A proof taken off the wire before its call arrives (a ``put`` of one batch) and
    spent first on ``destroy_pool``, ``clear_objects`` or a ``put`` of other objects
    (the verifier binds each claim to the call it came with: ``for_call``) is refused,
    and spends nothing: the rank's own call is then accepted (CONTROL). A claim no entry
    point bound (purpose ``""``) verifies no proof a rank sends. Control of the old
    design: its tag covered the session and number only, the same for every call."""
    from raykv.controllers.object_batch import ObjectBatch
    from raykv.controllers.owner_keys import call_purpose
    from raykv.controllers.ownership import for_call

    bindings = OwnerBindings()
    ranks = Ranks(bindings)
    batch = ObjectBatch(["k1"], ["pool"], [0], [4096])
    seen = ranks("a", call_purpose("put", batch))
    for method, args in (("destroy_pool", ("pool",)), ("clear_objects", ()),
                         ("put", (ObjectBatch(["k2"], ["pool"], [0], [4096]),))):
        with pytest.raises(ValueError, match="does not verify"):
            bindings.verify(for_call(seen, method, *args))
    with pytest.raises(ValueError, match="does not verify"):
        bindings.verify(seen)  # bound to no call
    assert bindings.verify(for_call(seen, "put", batch)).owner == seen.owner  # CONTROL
    with pytest.raises(ValueError, match="shown before"):
        bindings.verify(for_call(seen, "put", batch))
    # the old tag: one value for any method and arguments
    session_id, number, _ = seen.proof.split(".")
    assert old_call_tag(b"k" * 32, session_id, int(number)) == \
        old_call_tag(b"k" * 32, session_id, int(number))
    assert call_purpose("put", batch) != call_purpose("destroy_pool", "pool")


def test_a_claims_purpose_never_travels():
    """The purpose the verifier bound a claim to is not pickled (Ray) and not sent on
    the channel: whatever a caller sets, the verifier's entry point sets its own."""
    from raykv.cache_actors.channel_codec import Signature, parse_request, request
    from raykv.controllers.ownership import OwnerClaim

    claim = Ranks(OwnerBindings())("a").for_call("put:" + "0" * 32)
    assert claim.purpose and pickle.loads(pickle.dumps(claim)).purpose == ""
    assert pickle.loads(pickle.dumps(claim)) == claim  # the fields that do travel
    body = request("bind", 0.0, [claim])[4:]  # less the frame's length header
    _, _, (sent,) = parse_request(body, {"bind": Signature((OwnerClaim,))})
    assert sent == claim and sent.purpose == ""


def test_a_forgers_answer_with_the_tenants_digest_is_refused():
    """The tenant digest is public: signing with another key under it fails."""
    bindings = OwnerBindings(digests={"team-a": tenant_digest("team-a", ENV)})
    forger = OwnerKey.of_secret(SECRET_B)
    request, _ = answer_challenge(forger, bindings.challenge(), CLAIM.deployment_id,
                                  "team-a", CLAIM.key_prefix)
    with pytest.raises(ValueError, match="signature does not verify"):
        bindings.open_session(CLAIM, replace(request, public=tenant_digest("team-a", ENV)))


def test_call_numbers_may_come_out_of_order_within_the_window_only_once():
    window = CallWindow(size=8)
    assert [window.accept(n) for n in (3, 1, 2, 3, 20)] == [True, True, True, False, True]
    assert not window.accept(12) and window.accept(13)  # 8 below the highest: too old
    for n in range(21, 100):
        assert window.accept(n)
    assert len(window._seen) <= 16  # pruned: bounded whatever the traffic


def test_challenges_are_bounded_good_once_and_expire():
    now = [0.0]
    challenges = Challenges(max_open=2, ttl_s=10.0, clock=lambda: now[0])
    first, second = challenges.issue(), challenges.issue()
    challenges.issue()  # pushes the oldest out
    assert len(challenges) == 2
    with pytest.raises(ValueError, match="unknown"):
        challenges.take(first.nonce)
    now[0] = 10.0
    with pytest.raises(ValueError, match="expired"):
        challenges.take(second.nonce)
    third = challenges.issue()
    assert challenges.take(third.nonce) is not None  # control: answered in time
    with pytest.raises(ValueError):
        challenges.take(7)


def test_a_tenants_sessions_are_bounded_and_push_out_only_its_own():
    sessions = OwnerSessions(max_per_tenant=2)
    ids = [sessions.open("d", "team-a", "p", b"k" * 32) for _ in range(3)]
    other = sessions.open("e", "team-b", "q", b"k" * 32)
    assert len(sessions) == 3
    with pytest.raises(UnknownSessionError):
        sessions.check("d", "team-a", "p", RankSession(ids[0], b"k" * 32).call_proof(""), "")
    sessions.check("d", "team-a", "p", RankSession(ids[2], b"k" * 32).call_proof(""), "")
    sessions.check("e", "team-b", "q", RankSession(other, b"k" * 32).call_proof(""), "")


def test_the_controller_takes_a_registration_proof_once():
    challenges, keys = Challenges(), {}
    key = OwnerKey.of_secret(SECRET_A)
    proof = prove_registration(key, challenges.issue().nonce, CLAIM.deployment_id,
                               "team-a", CLAIM.key_prefix)
    verify_registration(challenges, keys, CLAIM, proof)  # control: its first showing
    assert keys == {"team-a": key.public}
    with pytest.raises(ValueError, match="challenge is unknown, answered already"):
        verify_registration(challenges, keys, CLAIM, proof)  # replayed
    forger = prove_registration(OwnerKey.of_secret(SECRET_B), challenges.issue().nonce,
                                CLAIM.deployment_id, "team-a", CLAIM.key_prefix)
    with pytest.raises(ValueError, match="owner key differs"):
        verify_registration(challenges, keys, CLAIM, forger)
    for bad in (None, old_static_proof(SECRET_A)):
        with pytest.raises(ValueError, match="needs a registration proof"):
            verify_registration(challenges, keys, CLAIM, bad)
    other = claim_of(StorageConfig(model_name="m", extra_config={"tenant": "team-b"}))
    proof = prove_registration(OwnerKey.of_secret(SECRET_B), challenges.issue().nonce,
                               other.deployment_id, "team-b", other.key_prefix)
    with pytest.raises(ValueError, match="binds no tenant on first use"):
        verify_registration(challenges, keys, other, proof, bound_only=True)
    assert "team-b" not in keys  # --bound-tenants-only: the table stays as bound


def test_owner_keys_are_deterministic_and_the_digest_is_the_public_key():
    assert OwnerKey.of_secret(SECRET_A).public == tenant_digest("team-a", ENV)
    assert OwnerKey.of_secret(SECRET_B).public != tenant_digest("team-a", ENV)
    assert SECRET_A.hex() not in tenant_digest("team-a", ENV)


@pytest.mark.parametrize("label", ["raykv/owner-key/v1", "raykv/tenant-sub-key/v2/owner-key",
                                   "raykv/tenant-sub-key/v2/page-hashes", "owner-key",
                                   "page-hashes"])
def test_no_keyed_page_hash_is_the_owner_keys_seed(label):
    """A page hash is whatever string a caller gives, and a keyed page hash travels (an
    object key anyone who reaches the store can list): none may be a seed of the owner
    key, whose private half signs for the tenant. The secret's uses have their own
    sub-keys. CONTROL (the old code, which keyed both uses with the secret itself: the
    owner key's seed was HMAC(secret, "raykv/owner-key/v1") and a keyed page hash
    HMAC(secret, page hash)): keying that label gave the seed, a key signing as the
    tenant."""
    (keyed,) = KeyedHashes(SECRET_A).keys([label])
    forged = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(keyed))
    owner = OwnerKey.of_secret(SECRET_A)
    assert forged.public_key().public_bytes_raw().hex() != owner.public
    message = transcript(SESSION, fresh_nonce(), "", "", "d", "team-a", "p")
    assert not signature_valid(owner.public, message, forged.sign(message).hex())
    assert signature_valid(owner.public, message, owner.sign(message))  # CONTROL: the key


@pytest.mark.parametrize("holder", [
    lambda: OwnerKey.of_secret(SECRET_A),
    lambda: RankOwner.of_config(CONFIG, ENV),
    lambda: KeyedHashes(SECRET_A),
    lambda: RankSession("0" * 32, b"k" * 32),
])
def test_what_holds_a_secret_is_never_pickled(holder):
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(holder())
    with pytest.raises(TypeError, match="never pickled"):
        copy.deepcopy(holder())
    assert pickle.loads(pickle.dumps(CLAIM)) == CLAIM  # control: a claim travels


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o440], ids=oct)
def test_a_secret_file_other_users_can_read_or_write_is_refused(tmp_path, mode):
    """The docs' word: a secret file other users cannot read (its group's users
    included), nor write (whoever writes it knows the secret). Nothing is read."""
    from raykv.controllers.tenancy import tenant_secret
    path = tmp_path / "secret"
    path.write_bytes(SECRET_A)
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"{mode:o}.*other users can read or write.*0400"):
        tenant_secret("team-a", {"RAYKV_TENANT_SECRET_FILE": str(path)})


def test_a_secret_file_is_read_when_the_variable_is_unset(tmp_path):
    """What a Ray Serve replica is handed instead of the secret itself (Ray shows every
    job a runtime environment's variables, never a file's contents)."""
    from raykv.controllers.tenancy import tenant_secret
    path = tmp_path / "secret"
    path.write_bytes(SECRET_A + b"\n")
    path.chmod(0o400)
    env = {"RAYKV_TENANT_SECRET_FILE": str(path)}
    assert tenant_secret("team-a", env) == SECRET_A  # its bytes, less the newline
    assert tenant_secret("team-a", env | ENV) == SECRET_A  # the variable first
    path.chmod(0o600)
    assert tenant_secret("team-a", env) == SECRET_A  # CONTROL: its owner may write it
    path.chmod(0o400)
    link = tmp_path / "link"
    link.symlink_to(path)
    for bad in (str(link), str(tmp_path), str(tmp_path / "none")):
        with pytest.raises(ValueError, match="RAYKV_TENANT_SECRET_FILE"):
            tenant_secret("team-a", {"RAYKV_TENANT_SECRET_FILE": bad})
    with pytest.raises(ValueError, match="is not set"):
        tenant_secret("team-a", {})
