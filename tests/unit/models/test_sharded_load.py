"""Sharded checkpoint loading, the parts one process can check: the fused q/k/v row map against TorchTitan's own
merge, a tied checkpoint without its head, and named errors. The per-rank read bound under FSDP2 and TP is
checked on real ranks in tests/integration/test_trainer.py::test_fsdp_and_tp_match_one_proc."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forge_rl.models import TINY_MODEL_DIR
from forge_rl.models.qwen3 import build_model
from forge_rl.models import fused_qkv
from forge_rl.models.sharded_load import SafetensorsCheckpoint


@pytest.mark.parametrize(
    "heads_per_kv, head_dim, start, stop", [(2, 8, 0, 64), (2, 8, 5, 37), (4, 4, 13, 14), (1, 16, 16, 48)]
)
def test_fused_qkv_rows_and_split_match_torchtitans_merge(heads_per_kv, head_dim, start, stop):
    n_kv = 2
    wq = torch.arange(n_kv * heads_per_kv * head_dim, dtype=torch.float32)[:, None] + 1000
    wk = torch.arange(n_kv * head_dim, dtype=torch.float32)[:, None] + 2000
    wv = torch.arange(n_kv * head_dim, dtype=torch.float32)[:, None] + 3000
    # FusedQKVLinear._merge_qkv_on_load's layout: per KV head, its query heads, then its key, then its value
    fused = torch.cat(
        [
            wq.reshape(n_kv, heads_per_kv, head_dim, 1),
            wk.reshape(n_kv, 1, head_dim, 1),
            wv.reshape(n_kv, 1, head_dim, 1),
        ],
        dim=1,
    ).reshape(-1, 1)
    stop = min(stop, len(fused))
    source = {"wq": wq, "wk": wk, "wv": wv}
    rows = torch.cat([source[s][a:b] for s, a, b in fused_qkv.rows(start, stop, heads_per_kv, head_dim)])
    assert torch.equal(rows, fused[start:stop])
    assert all(torch.equal(fused_qkv.split(fused, heads_per_kv, head_dim)[p], source[p]) for p in source)


def test_a_tied_checkpoint_without_its_head_loads_and_reads_are_counted(tmp_path):
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    (file,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(file)
    assert torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"])  # tied
    save_file(tensors, file, metadata={"format": "pt"})
    got, _ = build_model(tmp_path / "m")
    want, _ = build_model(TINY_MODEL_DIR)
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name
    checkpoint = SafetensorsCheckpoint(TINY_MODEL_DIR)
    block = checkpoint.read("model.layers.0.mlp.down_proj.weight", (4, 8), (3, 5))
    assert block.shape == (3, 5) and checkpoint.bytes_read == 60 and checkpoint.largest_read == 60


def test_reading_in_blocks_of_rows_loads_the_same_weights_and_no_read_exceeds_a_block():
    """A shard is read a block of rows at a time (block_bytes), fused q/k/v rows included: the same model, and
    the largest single read is one block (2 KB: 8 rows of the 128-wide fp32 tensors), not a tensor."""
    from forge_rl.models.qwen3 import Qwen3StateDictAdapter, titan_config
    from forge_rl.models.sharded_load import load_sharded

    want, _ = build_model(TINY_MODEL_DIR)
    config = titan_config(TINY_MODEL_DIR)
    with torch.device("meta"):
        got = config.build()
    got.to_empty(device="cpu")
    with torch.no_grad():
        got.init_states(buffer_device=torch.device("cpu"))
    stats = load_sharded(got, Qwen3StateDictAdapter(config, str(TINY_MODEL_DIR)), TINY_MODEL_DIR, block_bytes=4096)
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name
    assert 0 < stats["largest_read"] <= 4096
    assert stats["bytes_read"] == stats["checkpoint_bytes"] - 128 * 128 * 4 - _header_bytes(TINY_MODEL_DIR)


def _header_bytes(model_dir) -> int:
    """A safetensors file's bytes before its data (the 8-byte length and the JSON header)."""
    import struct

    (file,) = model_dir.glob("*.safetensors")
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_missing_and_extra_tensors_are_named(tmp_path):
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    (file,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(file)
    k_proj = tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint lacks \['layers.1.attention.qkv_linear.wk.weight'\]"):
        build_model(tmp_path / "m")
    tensors["model.layers.1.self_attn.k_proj.weight"] = k_proj
    tensors["model.layers.9.mlp.up_proj.weight"] = k_proj.clone()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint has tensors the model does not: .'layers.9.feed_forward"):
        build_model(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        SafetensorsCheckpoint(tmp_path)


def test_kept_parameters_the_checkpoint_lacks_keep_their_values_and_the_others_load(tmp_path):
    """trainer.freeze's parameters are not in a pushed version: a reference following the policy loads the rest
    and keeps its own copy of them (`kept`); a parameter the checkpoint lacks and nobody keeps is still an error."""
    from forge_rl.models.sharded_load import load_sharded

    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    (file,) = (tmp_path / "m").glob("*.safetensors")
    tensors = {k: v + 1 if k.startswith("model.layers.") else v for k, v in load_file(file).items()}
    frozen = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    model, adapter = build_model(TINY_MODEL_DIR)
    before = model.layers["0"].feed_forward.w3.weight.detach().clone()
    load_sharded(model, adapter, tmp_path / "m", kept=("layers.0.feed_forward",))
    assert torch.equal(model.layers["0"].feed_forward.w3.weight, before)  # kept, not the popped (+1) tensor
    assert torch.equal(model.layers["0"].feed_forward.w1.weight, tensors["model.layers.0.mlp.gate_proj.weight"])
    assert not torch.equal(before, frozen)
    with pytest.raises(ValueError, match=r"checkpoint lacks \['layers.0.feed_forward.w3.weight'\]"):
        load_sharded(model, adapter, tmp_path / "m", kept=("layers.1",))
