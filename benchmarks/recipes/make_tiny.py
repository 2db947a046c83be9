"""Write the tiny inputs both frameworks train on, with nothing downloaded:

    python make_tiny.py OUT

OUT/model: a Llama (2 decoder layers, hidden 64) with seeded random weights in fp32 safetensors
           and a byte-level BPE tokenizer trained here on the dataset's own text;
OUT/data/tiny_alpaca.json: 96 instruction/output pairs in the Alpaca format both frameworks
           read, with LLaMA-Factory's dataset_info.json beside it;
OUT/lora_r8, OUT/lora_r16: freshly initialized LoRA adapters (peft's default init, seeded: B = 0)
           on every linear layer but the head, at LLaMA-Factory's quickstart rank (8, alpha 16)
           and axolotl's (16, alpha 32). Both engines' LoRA runs start from the same one, so that
           the comparison does not depend on how model loading advanced the global RNG before
           peft drew A.

Run it with a framework's virtual environment: it saves with that environment's transformers.
"""
import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def examples(n=96):
    """Learnable pairs: count from a start by a stride, in words."""
    rows = []
    for i in range(n):
        start, stride, count = i % 10, 1 + i % 3, 4 + i % 5
        words = [NUMBERS[(start + stride * k) % 10] for k in range(count)]
        rows.append({"instruction": f"Count {count} numbers from {NUMBERS[start]} by {stride}.",
                     "input": "", "output": " ".join(words)})
    return rows


def tokenizer(texts):
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=SPECIAL[0],
                                   eos_token=SPECIAL[1], pad_token=SPECIAL[2])


def main(out):
    rows = examples()
    os.makedirs(f"{out}/data", exist_ok=True)
    with open(f"{out}/data/tiny_alpaca.json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(f"{out}/data/dataset_info.json", "w") as f:  # LLaMA-Factory's dataset registry
        json.dump({"tiny_alpaca": {"file_name": "tiny_alpaca.json"}}, f, indent=1)

    # The tokenizer learns the prompt templates' words too (LLaMA-Factory's "default"
    # template, axolotl's Alpaca prompt), so that sequences stay short.
    prompts = ["Human: Assistant: Below is an instruction that describes a task. "
               "Write a response that appropriately completes the request. "
               "### Instruction: ### Input: ### Response:"]
    tok = tokenizer(prompts + [r["instruction"] + " " + r["output"] for r in rows])
    tok.save_pretrained(f"{out}/model")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(f"{out}/model")

    from peft import LoraConfig, get_peft_model
    for rank in (8, 16):
        torch.manual_seed(rank)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"])
        get_peft_model(LlamaForCausalLM(config), lora).save_pretrained(f"{out}/lora_r{rank}")
    print(f"make_tiny: {out}/model ({len(tok)} tokens) and {out}/data ({len(rows)} rows)")


if __name__ == "__main__":
    main(sys.argv[1])
