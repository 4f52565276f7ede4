#!/usr/bin/env bash
# A plain `pip install hf-mot` (no extras) into a fresh virtual environment must import, translate and generate;
# plots are then skipped with a warning that names the extra. Run from the repository root (a minute or two).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet .
"$VENV/bin/python" - <<'PY'
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_mot import MoTConfig, MoTPair, MoTTranslator
from hf_mot.plotting import pyplot

# Small random models of two families with one character-level tokenizer: nothing to download.
chars = ["<pad>", "<bos>", "<eos>", "<unk>", *string.ascii_letters, *string.digits, *string.punctuation, " "]
tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
tok.decoder = decoders.Fuse()
tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                    unk_token="<unk>")
torch.manual_seed(0)
source = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
target = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1,
                                    eos_token_id=2)).eval()
pair = MoTPair(MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16)), source,
               tokenizer, target, tokenizer)
answer = pair.generate("A plain install translates.", " Answer:", max_new_tokens=3)
assert isinstance(answer, str) and pyplot() is None
print("plain install: imports, translates and generates; plots are optional")
PY
