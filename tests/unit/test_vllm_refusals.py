"""Models the vLLM connector does not serve are refused at start-up with a clear error,
from vLLM's own configs (docs/engines.md, vLLM "Limits"): an MLA model (a DeepSeek-V2
``config.json`` as vLLM reads it: ``use_mla``) and a model with more than one KV cache
group (vLLM's own grouping of a hybrid model's layers). With this connector vLLM turns
its hybrid KV cache manager off: a sliding-window model is then one group (served), a
hybrid SSM model is refused by vLLM itself; a config with several groups reaching the
connector (the manager on) is refused by it. CONTROL: a Llama of one group is served.
No Ray, no raykv cluster: every refusal comes before the connector attaches."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("vllm", reason="the vLLM connector's refusals need vLLM")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

from tests.peers.vllm_world import init_one_rank_world  # noqa: E402

BLOCK = 16
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
               "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
               "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
               "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
               "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
               "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
KV = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def vllm_config(tmp_path, hf_config: dict) -> VllmConfig:
    """vLLM's config of the model ``hf_config`` describes (its ``config.json`` only; no
    weights, no tokenizer), with the README's ``kv_transfer_config``, on the CPU."""
    folder = tmp_path / hf_config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config))
    return VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True,
                                 dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RayKVConnector", kv_connector_module_path="raykv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"model_name": "org/refused"}),
        device_config=DeviceConfig("cpu"))


def kv_cache_config(config: VllmConfig, specs: dict) -> KVCacheConfig:
    """The ``KVCacheConfig`` of layers ``specs`` as vLLM's engine core groups them."""
    groups = get_kv_cache_groups(config, dict(specs))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def hma_on(config: VllmConfig) -> VllmConfig:
    """``config`` with vLLM's hybrid KV cache manager on (what a connector with
    ``SupportsHMA`` would get): each kind of layer its own group."""
    out = copy.deepcopy(config)
    out.scheduler_config.disable_hybrid_kv_cache_manager = False
    out.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves first
    return out


def connector(config: VllmConfig, role, kv_config: KVCacheConfig | None):
    from raykv.integrations.vllm import RayKVConnector

    if role == KVConnectorRole.WORKER:
        init_one_rank_world(config)
    return RayKVConnector(config, role, kv_config)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_an_mla_model_is_refused(tmp_path, role):
    config = vllm_config(tmp_path, DEEPSEEK_V2)
    assert config.model_config.use_mla  # vLLM's own reading of the model
    with pytest.raises(ValueError, match="RayKVConnector does not serve MLA models"):
        connector(config, KVConnectorRole[role], None)


def test_a_model_of_several_kv_cache_groups_is_refused(tmp_path):
    config = vllm_config(tmp_path, LLAMA)
    # vLLM turns its hybrid manager off for this connector: a sliding-window model's
    # layers become one group of full attention (served), a hybrid SSM model is refused
    # by vLLM at start-up
    assert config.scheduler_config.disable_hybrid_kv_cache_manager
    sliding = {f"layers.{i}": SlidingWindowSpec(sliding_window=64, **KV) if i % 2 else
               FullAttentionSpec(**KV) for i in range(4)}
    one = kv_cache_config(config, sliding)
    assert [type(g.kv_cache_spec) for g in one.kv_cache_groups] == [FullAttentionSpec]
    mamba = {"layers.0": FullAttentionSpec(**KV), "layers.1": MambaSpec(
        block_size=BLOCK, shapes=((4, 8), (2, 8, 16)), dtypes=(torch.bfloat16,) * 2)}
    with pytest.raises(ValueError, match="one unified type"):
        kv_cache_config(config, mamba)
    # groups vLLM makes with its hybrid manager on: the connector refuses them
    two = kv_cache_config(hma_on(config), sliding)
    assert len(two.kv_cache_groups) == 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="serves models with one KV cache group; this "
                                             "model has 2"):
            connector(config, role, two)
    # CONTROL: the same model's one group is served (the worker attaches later, at
    # register_kv_caches, so nothing here needs raykv)
    worker = connector(config, KVConnectorRole.WORKER, one)
    assert worker.connector_worker is not None
    worker.shutdown()
