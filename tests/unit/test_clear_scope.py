"""``cache_actors.node.clear_scope``: the pattern of a deployment's keys matches every key its
ranks make and no key of another deployment or tenant (checked with Python's ``re`` on
bytes, which reads the pattern as the master's ECMAScript regex does)."""

import re

import pytest
from raykv.cache_actors.node.clear_scope import clear_pattern, regex_literal
from raykv.controllers import KeyScheme, StorageConfig
from raykv.controllers.ownership import OwnerClaim, claim_of

H = "5d85718ec594b982c252d0279e5966ffca33a5eaf2a455038d3ab331fde70cea"  # SGLang's shape
SECRET = "s" * 32


def matches(pattern: str, key: str) -> bool:
    return re.search(pattern.encode(), key.encode()) is not None


def claim(**kw) -> OwnerClaim:
    return claim_of(StorageConfig(**kw))  # a claim names no secret: sessions prove it


def every_key(config: StorageConfig, page_hash: str) -> list[str]:
    """Every object key a deployment of ``config`` makes for one page, on every rank."""
    out = []
    for tp in range(config.tp_size):
        for pp in range(config.pp_size):
            s = KeyScheme.from_config(StorageConfig(**{**config.__dict__, "tp_rank": tp,
                                                       "pp_rank": pp}))
            out += s.kv_keys(page_hash) + s.mamba_keys(page_hash, 12) + \
                s.indexer_keys(page_hash) + s.draft_keys(page_hash, False) + \
                s.draft_keys(page_hash, True) + s.swa_keys(page_hash, False) + \
                s.swa_keys(page_hash, True) + [s.tag(page_hash + "_0_k")]
    return out


@pytest.mark.parametrize("text", ["org-m_", "a/b.c", "t1.5=ac%2Fme.~_", "é-ü_", "[(^$\\|)]"])
def test_a_literal_matches_its_text_only(text):
    lit = "^" + regex_literal(text) + "$"
    assert matches(lit, text)
    assert not matches(lit, text + "x") and not matches(lit, "x" + text)
    assert not matches(lit, text[:-1] + "?")


@pytest.mark.parametrize("mla", [False, True])
def test_without_a_tenant_every_key_of_the_deployment_matches(mla):
    config = StorageConfig(model_name="org/m", tp_size=2, pp_size=2, is_mla_model=mla,
                           extra_config={"extra_backend_tag": "fleet"})
    pattern = clear_pattern(claim_of(config))
    for key in every_key(config, H):
        assert matches(pattern, key), key


def test_without_a_tenant_a_deployment_whose_prefix_extends_it_is_left_alone():
    """``org-m_`` is the start of ``org-m_x_`` (model ``org/m_x``): the pattern tells the
    two apart by the shape of the page hash and suffix."""
    mine, other = StorageConfig(model_name="org/m"), StorageConfig(model_name="org/m_x")
    pattern = clear_pattern(claim_of(mine))
    theirs = every_key(other, H)
    assert all(k.startswith("org-m_") for k in theirs)
    assert not any(matches(pattern, k) for k in theirs)
    # Even a model name with a page hash in it: its keys' own hash is too long a suffix.
    odd = StorageConfig(model_name=f"org/m_{H}")
    assert not any(matches(pattern, k) for k in every_key(odd, H))
    # Control: the prefix alone would take the other deployment's keys.
    assert all(matches("^" + regex_literal("org-m_"), k) for k in theirs)


def test_without_a_tenant_keys_of_another_shape_and_other_tenants_are_left_alone():
    pattern = clear_pattern(claim_of(StorageConfig(model_name="org/m")))
    assert not matches(pattern, "org-m_test_uuid")           # a pointer-API key
    assert not matches(pattern, f"org-m_{H[:-1]}_0_k")       # not a page hash
    assert not matches(pattern, f"x_org-m_{H}_0_k")          # anchored
    tenant_keys = every_key(StorageConfig(model_name="org/m", extra_config={
        "tenant": "acme"}), H)
    assert not any(matches(pattern, k) for k in tenant_keys)


def test_with_a_tenant_every_key_under_its_prefix_matches_and_nothing_else():
    config = StorageConfig(model_name="org/m", tp_size=2, extra_config={"tenant": "acme"})
    pattern = clear_pattern(claim(**config.__dict__))
    assert all(matches(pattern, k) for k in every_key(config, H))
    prefix = KeyScheme.from_config(config).prefix
    assert matches(pattern, prefix + "anything")             # its whole key space
    others = [StorageConfig(model_name="org/m", tp_size=2, extra_config={"tenant": "acm"}),
              StorageConfig(model_name="org/m", tp_size=4, extra_config={"tenant": "acme"}),
              StorageConfig(model_name="org/m", tp_size=2),
              StorageConfig(model_name="org/m2", tp_size=2, extra_config={"tenant": "acme"})]
    for other in others:
        assert not any(matches(pattern, k) for k in every_key(other, H)), other


def test_a_prefix_the_claim_does_not_own_is_refused():
    config = StorageConfig(model_name="org/m", extra_config={"tenant": "acme"})
    real = claim(**config.__dict__)
    proof = "a call proof made without the secret"
    # A tenant claiming another tenant's prefix (its own proof, their prefix).
    with pytest.raises(ValueError, match="not the one"):
        clear_pattern(OwnerClaim(real.deployment_id.replace("acme", "evil"), "evil", proof,
                                 real.key_prefix))
    # A rank without a tenant whose tag spells a tenant's prefix.
    with pytest.raises(ValueError, match="without a tenant"):
        clear_pattern(OwnerClaim(real.key_prefix, None, None, real.key_prefix))
    # A prefix that is not the claim's deployment id.
    with pytest.raises(ValueError, match="not the one"):
        clear_pattern(OwnerClaim("org-m_", None, None, "org-"))
    # Control: the real claims are accepted.
    assert clear_pattern(real) and clear_pattern(claim_of(StorageConfig(model_name="org/m")))


def test_no_prefix_and_no_claim_cannot_be_cleared():
    with pytest.raises(ValueError, match="no key prefix"):
        clear_pattern(claim_of(StorageConfig()))
    with pytest.raises(ValueError, match="owner claim"):
        clear_pattern(None)
