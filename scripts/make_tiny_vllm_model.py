"""Create a tiny random Llama-style model + locally trained tokenizer, fully offline.

usage: make_tiny_vllm_model.py OUT_DIR   (run with the vLLM venv's Python; scripts/setup_vllm.sh does)
A copy of shared/vllm/make_tiny_model.py, so the repository does not depend on shared/ at test time.
CPU attention in vLLM needs head_dim >= 32 (shared/vllm/README.md).
"""
import json
import os
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import torch

out = sys.argv[1]
os.makedirs(out, exist_ok=True)

# --- tokenizer: byte-level BPE trained on a small synthetic corpus ---
corpus = []
words = ("the quick brown fox jumps over the lazy dog hello world vllm serves "
         "tokens metrics prometheus kv cache request latency first token time "
         "queue waiting running engine core step watch model tiny llama").split()
import random
rng = random.Random(0)
letters = "etaoinshrdlcumwfgypbvkjxqz"
extra = ["".join(rng.choice(letters[: 8 + k % 18]) for _ in range(3 + k % 6)) for k in range(3000)]
for i in range(4000):
    corpus.append(" ".join(rng.choice(words + extra) for j in range(16)))
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=1000,
    special_tokens=["<s>", "</s>", "<pad>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train_from_iterator(corpus, trainer=trainer)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
)
hf_tok.chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
hf_tok.save_pretrained(out)
vocab = len(hf_tok)

# --- model ---
cfg = LlamaConfig(
    vocab_size=vocab,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    bos_token_id=hf_tok.bos_token_id,
    eos_token_id=hf_tok.eos_token_id,
    pad_token_id=hf_tok.pad_token_id,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
print("saved", out, "vocab", vocab, "params", sum(p.numel() for p in model.parameters()))
print(sorted(os.listdir(out)))
