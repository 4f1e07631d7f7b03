"""Every key rule of ``controllers.keys`` (the SGLang Mooncake backend's key table), and
tagging exactly once."""

import pytest
from raykv.controllers import KeyScheme, StorageConfig, key_prefix, mha_suffix, mla_suffix


def scheme(**kw) -> KeyScheme:
    return KeyScheme.from_config(StorageConfig(**kw))


@pytest.mark.parametrize(
    ("model", "tag", "prefix"),
    [
        (None, None, ""),
        ("org/toy", None, "org-toy_"),
        ("a/b/c", None, "a-b-c_"),
        (None, "fleet1", "fleet1_"),
        ("org/toy", "fleet1", "fleet1_org-toy_"),
        ("", "", ""),
    ],
)
def test_prefix(model, tag, prefix):
    assert key_prefix(model, tag) == prefix


def test_suffixes():
    assert mha_suffix(1, 0, 1) == "1"
    assert mha_suffix(1, 2, 4) == "1_2"
    assert mla_suffix(0, 1) == ""
    assert mla_suffix(3, 4) == "3"


def test_design_example():
    p = scheme(model_name="org/toy", tp_rank=0, tp_size=2)
    assert p.kv_keys("abc") == ["org-toy_abc_0_k", "org-toy_abc_0_v"]


def test_mha_kv_with_pp():
    p = scheme(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert p.kv_keys("h") == ["h_1_1_k", "h_1_1_v"]


def test_mla_kv():
    assert scheme(is_mla_model=True, tp_rank=1, tp_size=2).kv_keys("h") == ["h__k"]
    assert scheme(is_mla_model=True, pp_rank=1, pp_size=2).kv_keys("h") == ["h_1_k"]


def test_mamba_rank_scoped_even_in_mla():
    p = scheme(is_mla_model=True, tp_rank=1, tp_size=2, model_name="m")
    assert p.mamba_keys("h", num_conv=2) == ["m_h_1_temporal", "m_h_1_conv_0", "m_h_1_conv_1"]
    assert p.mamba_keys("h", num_conv=1, has_temporal=False) == ["m_h_1_conv_0"]


def test_indexer_replicated():
    assert scheme(tp_rank=1, tp_size=2).indexer_keys("h") == ["h__indexer"]
    assert scheme(pp_rank=1, pp_size=2).indexer_keys("h") == ["h_1_indexer"]


def test_draft_keys():
    p = scheme(tp_rank=1, tp_size=2)
    assert p.draft_keys("h", draft_is_mla=False) == ["h_1_draft_k", "h_1_draft_v"]
    assert p.draft_keys("h", draft_is_mla=True) == ["h__draft_k"]


def test_swa_keys():
    p = scheme(tp_rank=0, tp_size=2)
    assert p.swa_keys("h", swa_is_mla=False) == ["h_0_swa_k", "h_0_swa_v"]
    assert p.swa_keys("h", swa_is_mla=True) == ["h__swa"]


def test_tagged_exactly_once_with_tag_and_model():
    p = scheme(model_name="org/toy", extra_config={"extra_backend_tag": "t"})
    keys = p.kv_keys("h")
    assert keys == ["t_org-toy_h_0_k", "t_org-toy_h_0_v"]
    assert all(k.count("t_org-toy_") == 1 for k in keys)
    assert p.tag("h_0_k") == "t_org-toy_h_0_k"


@pytest.mark.parametrize("kw", [{"tp_rank": 2, "tp_size": 2}, {"pp_size": 0},
                                {"attn_cp_rank": -1}])
def test_config_rejects_bad_ranks(kw):
    with pytest.raises(ValueError, match="must be|out of range"):
        StorageConfig(**kw)


def test_timeout_s_is_one_validated_setting_in_extra_config():
    from raykv.controllers.contract import DEFAULT_TIMEOUT_S

    assert StorageConfig().timeout_s == DEFAULT_TIMEOUT_S
    assert StorageConfig(extra_config={"timeout_s": 0.5}).timeout_s == 0.5
    for bad in (0, -1, "5", True, None, 1e9):
        with pytest.raises(ValueError, match="timeout_s"):
            StorageConfig(extra_config={"timeout_s": bad})


def test_engine_id_is_a_short_str_in_extra_config():
    assert StorageConfig().engine_id is None
    assert StorageConfig(extra_config={"engine_id": "r1"}).engine_id == "r1"
    for bad in ("", "e" * 129, 3, b"r1"):
        with pytest.raises(ValueError, match="engine_id"):
            StorageConfig(extra_config={"engine_id": bad})
