"""Run inside vLLM's own virtualenv: make the real-vLLM tier's tiny model (and a tiny LoRA adapter for it).

    python make_tiny_model.py MODEL_DIR [--lora ADAPTER_DIR]

No model hub: a byte-level BPE tokenizer (vocabulary 2,048) is trained on the
first 200 modules of Python's standard library, and a Llama with random
bf16 weights (2 layers, hidden 256, 4 heads of 64: vLLM's CPU attention needs
a head size it has kernels for) is saved beside it, with a chat template of
special tokens. The same seed gives the same weights on every machine.

``--lora`` also writes a PEFT-format adapter (``adapter_config.json`` and
``adapter_model.safetensors``, rank 8 on ``q_proj``/``v_proj``) with small
random weights: what vLLM's ``--lora-modules NAME=DIR`` loads.
"""

import argparse
import glob
import json
import os
import sysconfig

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
HIDDEN, HEADS, LAYERS, LORA_RANK = 256, 4, 2, 8


def make_tokenizer(out: str) -> Tokenizer:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIALS, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "</s>", "add_bos_token": False, "model_max_length": 512,
                   "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, f, indent=2)
    return tok


def make_model(out: str, tok: Tokenizer) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=eos, tie_word_embeddings=False)
    config.dtype = "bfloat16"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(out)


def make_lora(out: str, base: str) -> None:
    os.makedirs(out, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, LORA_RANK, generator=generator) * 0.01
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
                   "r": LORA_RANK, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False, "inference_mode": True,
                   "modules_to_save": None, "use_rslora": False, "use_dora": False}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--lora", help="also write a tiny random LoRA adapter here")
    args = parser.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    make_model(args.model_dir, make_tokenizer(args.model_dir))
    if args.lora:
        make_lora(args.lora, args.model_dir)
    print("made", args.model_dir, args.lora or "")


if __name__ == "__main__":
    main()
