"""Build a tiny, randomly initialised Llama-style model with a locally trained BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on generated text, the weights are random with a
fixed seed (deterministic), saved as safetensors. Reused when the directory already holds one.
Run it with the Python that has vLLM (it needs torch, transformers, tokenizers):

    .venv-vllm/bin/python scripts/make_tiny_model.py .cache/tiny-llama
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SPEC = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 64: vLLM's CPU attention kernel rejects 16
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "seed": 0,
    "version": 1,
}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "model", "token",
         "memory", "cuda", "engine", "server", "request", "prompt", "alpha", "beta", "gamma", "delta", "word"]


def build(out: Path) -> Path:
    marker = out / "tiny-model.json"
    if marker.exists() and json.loads(marker.read_text()) == SPEC:
        print(f"tiny model already built at {out}")
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SPEC["seed"])

    def corpus() -> Iterator[str]:
        for _ in range(5000):
            yield " ".join(rng.choice(WORDS) + (str(rng.randint(0, 99)) if rng.random() < 0.2 else "")
                           for _ in range(rng.randint(5, 30)))

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SPEC["vocab_size"], special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=SPEC["max_position_embeddings"])
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(out)

    # The embedding is wider than the tokenizer (padding rows), so prompt_logprobs allocations are large.
    cfg = LlamaConfig(vocab_size=max(SPEC["vocab_size"], len(fast)), hidden_size=SPEC["hidden_size"],
                      intermediate_size=SPEC["intermediate_size"], num_hidden_layers=SPEC["num_hidden_layers"],
                      num_attention_heads=SPEC["num_attention_heads"], num_key_value_heads=SPEC["num_key_value_heads"],
                      max_position_embeddings=SPEC["max_position_embeddings"], tie_word_embeddings=False,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(SPEC["seed"])
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(SPEC))
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny model ({n / 1e6:.1f}M params, vocab {len(fast)}) built at {out} in {time.time() - t0:.1f}s")
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-llama"))
