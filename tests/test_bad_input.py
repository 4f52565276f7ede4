"""Bad input that earlier tests leave out, as one table: each case names what it gets wrong, and the error must
be the documented one (docs/ERRORS.md), with a message that says what to do."""

import pytest
import torch
from conftest import CONTEXTS, char_tokenizer, identity_translator, tiny_model
from transformers import BertConfig, BertModel, DynamicCache

from hf_mot import MoTConfig, MoTTranslator, TranslatedCache, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.alignment import encode_contexts

MODEL, TOKENIZER = tiny_model("llama"), char_tokenizer()
ORACLE = identity_translator(MODEL, TOKENIZER)
MODELS = dict(translator=ORACLE, source_model=MODEL, source_tokenizer=TOKENIZER, target_model=MODEL,
              target_tokenizer=TOKENIZER)


def _int_cache():
    cache = DynamicCache()
    ids = encode_contexts(TOKENIZER, [CONTEXTS[0]]).input_ids
    with torch.no_grad():
        MODEL(input_ids=ids, use_cache=True, **{cache_kwarg(MODEL): cache})
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.long(), layer.values.long()
    return cache


def _generate_with_wrong_rows():
    cache = translate_context(CONTEXTS[:2], **MODELS)
    prompt = TOKENIZER([" A:"] * 3, return_tensors="pt", add_special_tokens=False).input_ids
    MODEL.generate(input_ids=prompt, attention_mask=torch.ones(3, 40, dtype=torch.long), max_new_tokens=1,
                   **{cache_kwarg(MODEL): cache})


def _bert_source():
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                vocab_size=320))
    translator = MoTTranslator(MoTConfig.from_models(bert.config, MODEL.config, hidden_size=16))
    translate_context(CONTEXTS[0], **{**MODELS, "source_model": bert, "translator": translator})


def _dataset(**kwargs):
    from hf_mot.training.data import ContextContinuationDataset

    return ContextContinuationDataset(**{"split": "train", **kwargs})


def _trainer(**kwargs):
    from transformers import TrainingArguments

    from hf_mot.training import MoTTrainer, MoTTrainingArguments

    args = kwargs.pop("args", None) or MoTTrainingArguments("unused", use_cpu=True, report_to="none")
    if args == "plain":
        args = TrainingArguments("unused", use_cpu=True, report_to="none")
    return MoTTrainer(model=ORACLE, args=args, source_model=MODEL, target_model=MODEL, **kwargs)


def _widen_per_layer():
    from hf_mot.training.widen import widen_translator

    config = MoTConfig.from_models(MODEL.config, MODEL.config, architecture="per_layer", expert_hidden_size=8)
    widen_translator(MoTTranslator(config), hidden_size=512)


def _narrow():
    from hf_mot.training.widen import KVMixture, widen_mixture

    config = MoTConfig.from_models(MODEL.config, MODEL.config, hidden_size=16)
    narrow = KVMixture(config, config.source_layout, config.target_layout)
    wide = KVMixture(MoTConfig.from_models(MODEL.config, MODEL.config, hidden_size=8), config.source_layout,
                     config.target_layout)
    widen_mixture(narrow, wide, 0.02)


def _forward(**kwargs):
    from hf_mot.alignment import align_contexts
    from hf_mot.kv import read_source_cache
    from hf_mot.pipeline import prefill_source

    config = MoTConfig.from_models(MODEL.config, MODEL.config, hidden_size=16)
    encoded = encode_contexts(TOKENIZER, [CONTEXTS[0]])
    kv = read_source_cache(prefill_source(MODEL, encoded), MODEL, encoded.attention_mask)
    MoTTranslator(config)(kv.keys, kv.values, align_contexts(encoded, encoded), **kwargs)


CASES = {
    # name: (call, exception, message)
    "source cache of integers": (lambda: translate_context(CONTEXTS[0], source_cache=_int_cache(), **MODELS),
                                 TypeError, r"holds torch.int64 tensors; a floating point cache is needed"),
    "source cache that is not a Cache": (lambda: translate_context(CONTEXTS[0], source_cache=[(1, 2)], **MODELS),
                                         TypeError, r"`source_cache` must be a transformers `Cache`"),
    "generate with more rows than contexts": (_generate_with_wrong_rows, ValueError,
                                              r"The cache holds 2 contexts but `input_ids` has 3 rows"),
    "source model that is not a decoder": (_bert_source, TypeError,
                                           r"Cannot find the decoder layers of BertModel: it is not a supported"),
    "translator forward without target embeddings": (_forward, ValueError, r"pass `target_embeddings="),
    "translator forward with a wrong last_tokens": (lambda: _forward(last_tokens=[None]), ValueError,
                                                    r"`last_tokens` needs one entry per target layer \(2\), got 1"),
    "unknown training split": (lambda: _dataset(split="test"), ValueError, r"`split` must be 'train' or 'validation'"),
    "context words out of order": (lambda: _dataset(context_words=(9, 4)), ValueError,
                                   r"`context_words` must be \(min, max\) with 1 <= min <= max"),
    "pair shares over 1": (lambda: _dataset(recall_fraction=0.7, question_fraction=0.5), ValueError,
                           r"must be at least 0 and add up to at most 1"),
    "trainer with plain TrainingArguments": (lambda: _trainer(args="plain"), TypeError,
                                             r"`args` must be `MoTTrainingArguments`"),
    "trainer with unknown fresh parameters": (lambda: _trainer(fresh_parameters=["nope.weight"]), ValueError,
                                              r"`fresh_parameters` names parameters the translator does not have"),
    "widening the per-layer baseline": (_widen_per_layer, ValueError, r"Only mixture translators can be widened"),
    "narrowing a mixture": (_narrow, ValueError, r"Can only widen a mixture \(hidden 16 -> 8"),
    "unknown evaluation task": (
        lambda: __import__("hf_mot.evaluation.report", fromlist=["run_evaluation"]).run_evaluation(
            tasks=("trivia",), translator=ORACLE, source_model=MODEL, source_tokenizer=TOKENIZER, target_model=MODEL,
            target_tokenizer=TOKENIZER),
        ValueError, r"Unknown tasks \['trivia'\]; choose from"),
    "unknown held-out part": (
        lambda: __import__("hf_mot.evaluation.fidelity", fromlist=["heldout_examples"]).heldout_examples(
            TOKENIZER, (64,), 1, part="dev"),
        ValueError, r"`part` must be one of \('test', 'selection'\)"),
    "injection window outside the target": (
        lambda: __import__("hf_mot.evaluation.injection", fromlist=["translate_with_window"]).translate_with_window(
            CONTEXTS[0], window=(1, 5), **MODELS),
        ValueError, r"`window=\(1, 5\)` must name layers inside the target's 2"),
    "push options without push_to_hub": (lambda: ORACLE.save_pretrained("unused", private=True), TypeError,
                                         r"\['private'\] only mean something with `push_to_hub=True`"),
    "unknown push_to_hub argument": (lambda: ORACLE.push_to_hub("org/name", privte=True), TypeError,
                                     r"push_to_hub got unexpected arguments: \['privte'\]"),
    "pickle weights asked for": (lambda: MoTTranslator.from_pretrained("unused", use_safetensors=False), ValueError,
                                 r"load from safetensors only \(no pickle\)"),
    "data package not installed": (
        lambda: __import__("hf_mot.data", fromlist=["package_file"]).package_file("no_such_package", "x", "pip x"),
        ModuleNotFoundError, r"The data package `no_such_package` is not installed: `pip x`"),
    "data file missing from its package": (
        lambda: __import__("hf_mot.data", fromlist=["package_file"]).package_file("hf_mot", "no/such.jsonl", "pip y"),
        FileNotFoundError, r"no/such.jsonl is missing from `hf_mot`: reinstall it with `pip y`"),
    "depth-matched path on the per-layer baseline": (
        lambda: MoTConfig.from_models(MODEL.config, MODEL.config, architecture="per_layer", depth_matched_layers=1),
        ValueError, r"`depth_matched_layers` needs `architecture='mixture'`"),
    "cache file that is not a translated cache": (lambda: TranslatedCache.load(_plain_safetensors(), MODEL.config),
                                                  ValueError, r"is not a translated cache written by"),
    "cache file for a deeper target": (lambda: TranslatedCache.load(_saved(), tiny_model("qwen2").config),
                                       ValueError, r"holds 2 layers but the target config has 3"),
}


def _plain_safetensors():
    import tempfile

    from safetensors.torch import save_file

    path = tempfile.mkdtemp() + "/plain.safetensors"
    save_file({"x": torch.zeros(2)}, path)
    return path


def _saved():
    import tempfile

    path = tempfile.mkdtemp() + "/cache.safetensors"
    translate_context(CONTEXTS[0], **MODELS).save(path)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_its_documented_error(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a case might write lands in the repository
    call, error, message = CASES[case]
    with pytest.raises(error, match=message):
        call()


def test_translate_output_must_be_safetensors(capsys, tmp_path, monkeypatch):
    from hf_mot.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["translate", "--context", "x", "--output", "cache.pt"]) == 1
    assert capsys.readouterr().err.strip() == (
        "hf-mot translate: error: --output must end in .safetensors, got cache.pt.")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "edit", [(b'"seen_tokens":"[', b'"seen_tokens":"{'), (b'"native_tokens":"0"', b'"native_tokens":"x"')]
)
def test_cache_file_with_corrupted_metadata(tmp_path, edit):
    """A flipped byte inside the metadata `save` writes (found by tests/test_fuzz.py) is a `ValueError` that names
    the file, not a bare JSON error."""
    path = tmp_path / "cache.safetensors"
    translate_context(CONTEXTS[0], **MODELS).save(path)
    blob = path.read_bytes()
    assert blob.count(edit[0]) == 1
    path.write_bytes(blob.replace(*edit))
    with pytest.raises(ValueError, match=rf"{path} has corrupted metadata"):
        TranslatedCache.load(path, MODEL.config)
