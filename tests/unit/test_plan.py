"""`vllm-supervisor plan`: KV bytes per token from config.json, and what fits (the seed's formula)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from supervisor.bounds import GIB
from supervisor.decide.plan import ModelShape, kv_bytes_per_token, kv_dtype_bytes, make_plan

TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 8192, "dtype": "float32"}
# GLM-4-9B's shape (the seed's model): 40 layers, 2 KV groups of 128.
GLM4 = {"num_layers": 40, "num_attention_heads": 32, "multi_query_group_num": 2, "hidden_size": 4096,
        "ffn_hidden_size": 13696, "seq_length": 131072, "torch_dtype": "bfloat16"}


def test_kv_bytes_per_token_as_vllm_sizes_its_cache() -> None:
    tiny = ModelShape.from_config(TINY)
    assert kv_dtype_bytes(tiny.dtype) == 2  # a float32 checkpoint is served in 16 bits
    assert kv_bytes_per_token(tiny, 2) == 1024  # 268435456 bytes held 262,144 tokens in real vLLM (fixtures)
    glm = ModelShape.from_config(GLM4)
    assert kv_bytes_per_token(glm, kv_dtype_bytes(glm.dtype)) == 2 * 40 * 2 * 128 * 2
    assert kv_dtype_bytes("bfloat16", kv_cache_dtype="fp8") == 1


def test_a_kv_budget_gives_the_tokens_and_the_seqs_that_fit() -> None:
    p = make_plan(ModelShape.from_config(TINY), card_bytes=None, weights_bytes=0, kv_budget=GIB // 4,
                  max_model_len=4096)
    assert (p.kv_tokens, p.max_model_len, p.max_num_seqs) == (262144, 4096, 64)  # vLLM said 64.00x concurrency


def test_the_seeds_card_sizes_glm4_and_cuts_what_does_not_fit() -> None:
    glm = ModelShape.from_config(GLM4)
    p = make_plan(glm, card_bytes=80 * GIB, weights_bytes=18 * GIB, utilization=0.9)
    assert p.max_model_len == 131072 and 1 <= p.max_num_seqs <= 256
    assert p.kv_tokens * p.per_token <= 80 * GIB * 0.9 - 18 * GIB
    small = make_plan(glm, card_bytes=24 * GIB, weights_bytes=18 * GIB, utilization=0.9)
    assert small.max_model_len < 131072 and any("cut" in n for n in small.notes)
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        make_plan(glm, card_bytes=16 * GIB, weights_bytes=18 * GIB)


def test_plan_command_prints_toml_that_the_config_accepts(tmp_path: Path) -> None:
    import tomllib

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(2 * GIB)
    out = subprocess.run([sys.executable, "-m", "supervisor", "plan", "--model", str(tmp_path), "--gpu-mem", "24"],
                         capture_output=True, text=True, check=True).stdout
    doc = tomllib.loads(out)
    from supervisor.config_file import parse

    cfg = parse({"engine": {"model": "m"}, **doc})
    assert cfg.profile.max_num_batched_tokens == 8192 and cfg.ladder.max_num_batched_tokens[0] == 8192
    bad = subprocess.run([sys.executable, "-m", "supervisor", "plan", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot read its config.json" in bad.stderr


def test_plan_counts_what_vllm_loads_and_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    """Issue 18, item 11: no weight files counted as 0 GiB silently; .bin and .safetensors were both counted."""
    (tmp_path / "config.json").write_text(json.dumps(GLM4))
    cmd = [sys.executable, "-m", "supervisor", "plan", "--model", str(tmp_path), "--gpu-mem", "80"]
    bare = subprocess.run(cmd, capture_output=True, text=True)
    assert bare.returncode == 2 and "--weights-gib" in bare.stderr and bare.stdout == ""
    given = subprocess.run([*cmd, "--weights-gib", "17.5"], capture_output=True, text=True, check=True).stdout
    for name in ("model-00001.safetensors", "pytorch_model.bin"):  # the same 17.5 GiB in two formats
        with open(tmp_path / name, "wb") as f:
            f.truncate(int(17.5 * GIB))
    found = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "weights 17.50 GiB" in found and found == given
    # No GPU here and no --gpu-mem: the error on stderr, nothing (no NVML notice) on stdout.
    nogpu = subprocess.run(cmd[:-2], capture_output=True, text=True)
    assert nogpu.returncode == 2 and nogpu.stdout == ""


def test_plan_reads_chatglm_kv_channels_reserves_vllms_own_memory_and_divides_by_tensor_parallel_size() -> None:
    glm = ModelShape.from_config({**GLM4, "kv_channels": 128, "num_attention_heads": 32, "hidden_size": 8192})
    assert glm.head_size == 128  # kv_channels, not hidden / heads (256)
    seed = ModelShape.from_config(GLM4)
    p = make_plan(seed, card_bytes=80 * GIB, weights_bytes=18 * GIB, utilization=0.9, max_model_len=128000)
    assert p.max_num_seqs == 10  # the seed's host: 10 fit at 128,000
    import supervisor.decide.plan as plan_mod

    assert p.kv_budget == int(80 * GIB * 0.9) - 18 * GIB - plan_mod.RESERVE_BYTES - \
        plan_mod.activation_bytes(seed, p.chunk, 2)  # vLLM's non-torch memory and graphs are not KV cache
    fp8 = make_plan(seed, card_bytes=80 * GIB, weights_bytes=18 * GIB, kv_cache_dtype="fp8", max_model_len=128000)
    assert fp8.kv_tokens >= 2 * p.kv_tokens - 2  # activations stay 16-bit: only the KV cache halves per token
    tp2 = make_plan(seed, card_bytes=80 * GIB, weights_bytes=18 * GIB, max_model_len=128000, tensor_parallel_size=2)
    assert tp2.shape.kv_heads == 1 and tp2.kv_tokens > p.kv_tokens and "tensor_parallel_size 2" in tp2.notes[0]


def _plan_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "plan", *args], capture_output=True, text=True,
                          cwd=cwd, env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])})


def test_plan_reads_a_relative_model_path_and_refuses_inputs_it_cannot_mean(tmp_path: Path) -> None:
    """Issue 28, item 5: `--model models/glm` counted no weights (read as a hub id); `--utilization 1.5` passed."""
    model = tmp_path / "models" / "glm"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(GLM4))
    with open(model / "model-00001.safetensors", "wb") as f:
        f.truncate(int(17.5 * GIB))
    relative = _plan_cli("--model", "models/glm", "--gpu-mem", "80", cwd=tmp_path)
    assert relative.returncode == 0 and "weights 17.50 GiB" in relative.stdout, relative.stderr
    for flag, value, said in (("--utilization", "1.5", "(0, 1]"), ("--utilization", "0", "> 0"),
                              ("--gpu-mem", "-80", "> 0"), ("--gpu-mem", "nan", "> 0"),
                              ("--max-model-len", "12.5", "not an integer"), ("--tensor-parallel-size", "0", "> 0"),
                              ("--sequences", "0", "> 0"), ("--kv-cache-dtype", "int3", "not one of"),
                              ("--weights-gib", "-1", ">= 0")):
        bad = _plan_cli("--model", "models/glm", "--gpu-mem", "80", flag, value, cwd=tmp_path)
        assert bad.returncode == 2 and flag in bad.stderr and said in bad.stderr and bad.stdout == "", (flag, bad)


def test_plan_in_reverse_says_what_n_sequences_of_l_tokens_need_and_the_forward_plan_agrees(tmp_path: Path) -> None:
    """The field report expected 10 concurrent 128k sequences at utilization 0.4 on an 80 GB card."""
    import tomllib

    from supervisor.decide.plan import need_for

    glm = ModelShape.from_config(GLM4)
    card, weights = 80 * 10**9, int(17.5 * GIB)
    for seqs, length in ((10, 131072), (1, 4096), (64, 8192), (3, 100_000)):
        need = need_for(glm, sequences=seqs, length=length, weights_bytes=weights, card_bytes=card)
        util = need.utilization_needed
        assert util is not None
        if util <= 1:  # the forward formula at that utilization holds them, and 0.01 less does not
            assert make_plan(glm, card_bytes=card, weights_bytes=weights, utilization=util,
                             max_model_len=length).max_num_seqs >= seqs
            try:
                below = make_plan(glm, card_bytes=card, weights_bytes=weights, utilization=round(util - 0.01, 2),
                                  max_model_len=length)
            except ValueError:  # nothing left for the KV cache at all
                continue
            assert below.max_num_seqs < seqs or below.max_model_len < length
    (tmp_path / "config.json").write_text(json.dumps(GLM4))
    out = _plan_cli("--model", str(tmp_path), "--weights-gib", "17.5", "--gpu-mem", str(80 * 10**9 / GIB),
                    "--sequences", "10", "--max-model-len", "131072")
    assert out.returncode == 0, out.stderr
    assert "needs gpu_memory_utilization 0.94 on this 74.5 GiB card" in out.stdout
    doc = tomllib.loads(out.stdout)
    assert doc["profile"] == {"gpu_memory_utilization": 0.94, "max_model_len": 131072, "max_num_seqs": 10,
                              "max_num_batched_tokens": 8192}
    # Without a card: the card it needs at the utilization asked; too much for the card: no [profile] at all.
    sized = _plan_cli("--model", str(tmp_path), "--weights-gib", "17.5", "--sequences", "10",
                      "--max-model-len", "131072", "--utilization", "0.4")
    assert sized.returncode == 0 and "a 174.2 GiB card at gpu_memory_utilization 0.4" in sized.stdout, sized
    over = _plan_cli("--model", str(tmp_path), "--weights-gib", "17.5", "--gpu-mem", "40", "--sequences", "10",
                     "--max-model-len", "131072")
    assert over.returncode == 0 and "more than this 40.0 GiB card holds" in over.stdout
    assert "profile" not in tomllib.loads(over.stdout)
