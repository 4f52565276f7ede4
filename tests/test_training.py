"""Training: the loss terms, one step, resume after a kill, two processes with accelerate."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, tiny_model
from safetensors.torch import load_file
from transformers import AutoConfig

from hf_mot import MoTConfig, MoTTranslator
from hf_mot.data import training_documents
from hf_mot.training import LossWeights, MoTDataCollator, MoTTrainer, MoTTrainingArguments, context_correction_loss
from hf_mot.training.data import ContextContinuationDataset, cut_chunks, document_split
from hf_mot.training.layer_fit import with_dedicated_layers
from hf_mot.training.widen import widen_translator


def _pair(architecture="mixture"):
    source, target = tiny_model("llama", seed=1), tiny_model("gemma3", seed=2)
    source_tok, target_tok = char_tokenizer(), bpe_tokenizer()
    options = {"architecture": architecture}
    if architecture == "mixture":
        options.update(depth_matched_layers=1)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=source_tok,
                                   target_tokenizer=target_tok, hidden_size=16, expert_hidden_size=16, **options)
    torch.manual_seed(0)
    return MoTTranslator(config), source, target, MoTDataCollator(source_tok, target_tok)


def _examples():
    return [{"context": c[:50], "continuation": c[50:]} for c in CONTEXTS[:4]]


def test_every_term_is_finite_and_reaches_only_the_translator():
    translator, source, target, collate = _pair()
    batch = collate(_examples())
    weights = LossWeights()
    terms = ("nll", "kv", "kl", "balance", "hidden")
    for term in terms:
        translator.zero_grad()
        # The trajectory term is off by default: it gets weight 1 here.
        only = LossWeights(**{f"{name}_weight": ((getattr(weights, f"{name}_weight") or 1.0) if name == term else 0.0)
                              for name in terms})
        parts = context_correction_loss(translator, source, target, batch, only)
        value = getattr(parts, term)
        assert torch.isfinite(value) and value.item() > 0, term
        parts.total.backward()
        grads = [p.grad for p in translator.parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads), f"{term} has no gradient path to the translator"
        paths = (translator.key_mixture.target_tokens.proj_weight, translator.value_mixture.depth_matched.weight)
        for path in paths:
            if term != "balance":  # the router's loss does not depend on the output paths
                assert path.grad is not None and path.grad.abs().sum() > 0, f"{term} does not reach {path.shape}"
        assert all(p.grad is None for p in list(source.parameters()) + list(target.parameters())), term


def test_the_trajectory_term_is_zero_for_the_native_cache_and_off_by_default():
    model, collate = tiny_model("gemma3", seed=2), MoTDataCollator(bpe_tokenizer(), bpe_tokenizer())
    oracle = MoTTranslator(MoTConfig.from_models(model.config, model.config, init="identity"))
    batch = collate(_examples())
    hidden_only = LossWeights(nll_weight=0.0, kv_weight=0.0, kl_weight=0.0, balance_weight=0.0, hidden_weight=1.0)
    with torch.no_grad():
        native = context_correction_loss(oracle, model, model, batch, hidden_only)
        assert native.hidden.item() == pytest.approx(0.0, abs=1e-6)
        assert native.total.item() == pytest.approx(0.0, abs=1e-6)
        translator, source, target, collate = _pair()
        batch = collate(_examples())
        on = context_correction_loss(translator, source, target, batch, hidden_only)
        off = context_correction_loss(translator, source, target, batch, LossWeights())
    assert on.hidden.item() > 1e-3 and on.total.item() == pytest.approx(on.hidden.item())
    assert LossWeights().hidden_weight == 0.0 and off.hidden.item() == 0.0


def test_kl_first_weight_counts_the_first_continuation_positions_more():
    translator, source, target, collate = _pair()
    kl_only = {"nll_weight": 0.0, "kv_weight": 0.0, "balance_weight": 0.0}

    def parts(examples, kl_first):
        with torch.no_grad():
            return context_correction_loss(translator, source, target, collate(examples),
                                           LossWeights(**kl_only, kl_first_weight=kl_first))

    plain, front = parts(_examples(), 1.0), parts(_examples(), 5.0)
    assert front.kl.item() == pytest.approx(plain.kl.item())  # the logged KL stays the plain mean
    assert plain.total.item() == pytest.approx(plain.kl.item())
    assert plain.kl.item() < front.total.item() < 5 * plain.kl.item()
    # Continuations of one token are all first positions: the whole KL counts 5 times.
    single = [{"context": e["context"], "continuation": e["continuation"][0]} for e in _examples()]
    assert collate(single)["continuation_ids"].shape[1] == 1
    one = parts(single, 5.0)
    assert one.total.item() == pytest.approx(5 * one.kl.item(), rel=1e-5)
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        LossWeights(kl_first_weight=-1.0)


def test_question_nll_weight_scales_the_next_token_loss_of_question_pairs_only():
    translator, source, target, collate = _pair()
    examples = _examples()
    examples[1], examples[3] = {**examples[1], "question": True}, {**examples[3], "question": True}
    nll_only = {"kv_weight": 0.0, "kl_weight": 0.0, "balance_weight": 0.0}

    def nll(batch_examples, question_nll):
        with torch.no_grad():
            return context_correction_loss(translator, source, target, collate(batch_examples),
                                           LossWeights(**nll_only, question_nll_weight=question_nll)).nll.item()

    assert collate(examples)["question"].tolist() == [False, True, False, True]
    # Weight 1: the plain mean, as if no pair were a question pair.
    plain = [{"context": e["context"], "continuation": e["continuation"]} for e in examples]
    assert nll(examples, 1.0) == pytest.approx(nll(plain, 1.0))
    # Weight 0: the mean over the other pairs only (padding moves the result by float error only).
    others = [examples[0], examples[2]]
    assert nll(examples, 0.0) == pytest.approx(nll(others, 1.0), rel=1e-4)
    assert nll(examples, 0.0) != pytest.approx(nll(examples, 1.0), rel=1e-3)
    # A batch of question pairs only keeps its KV and KL terms.
    questions = [examples[1], examples[3]]
    with torch.no_grad():
        parts = context_correction_loss(translator, source, target, collate(questions),
                                        LossWeights(question_nll_weight=0.0))
    assert parts.nll.item() == 0.0 and parts.kv.item() > 0 and parts.kl.item() > 0
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        LossWeights(question_nll_weight=-1.0)


def test_kv_full_attention_weight_weighs_the_full_attention_layers_in_the_kv_term():
    translator, source, target, collate = _pair()
    batch = collate(_examples())
    assert target.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]

    def kv(weight):
        with torch.no_grad():
            return context_correction_loss(translator, source, target, batch, LossWeights(
                nll_weight=0.0, kl_weight=0.0, balance_weight=0.0, kv_full_attention_weight=weight)).kv.item()

    # kv(w) = (S + w F) / (2 + w), with S the two sliding layers' errors summed and F the full layer's.
    sliding_sum = 2 * kv(0.0)
    full = 3 * kv(1.0) - sliding_sum
    assert full > 0 and sliding_sum > 0 and full != pytest.approx(sliding_sum / 2, rel=1e-3)
    assert kv(4.0) == pytest.approx((sliding_sum + 4 * full) / 6, rel=1e-5)
    # A target of full-attention layers only has nothing to weigh: the weight changes nothing.
    everywhere = tiny_model("llama", seed=2)
    config = MoTConfig.from_models(source.config, everywhere.config, source_tokenizer=char_tokenizer(),
                                   target_tokenizer=bpe_tokenizer(), hidden_size=16, expert_hidden_size=16)
    torch.manual_seed(0)
    plain = MoTTranslator(config)
    with torch.no_grad():
        terms = [context_correction_loss(plain, source, everywhere, batch, LossWeights(
            nll_weight=0.0, kl_weight=0.0, balance_weight=0.0, kv_full_attention_weight=weight)).kv.item()
            for weight in (0.0, 1.0, 4.0)]
    assert terms[0] > 0 and terms == pytest.approx([terms[1]] * 3)
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        LossWeights(kv_full_attention_weight=-1.0)


@pytest.mark.parametrize("architecture", ["mixture", "per_layer"])
def test_one_step_lowers_the_loss_on_a_fixed_batch(tmp_path, architecture):
    translator, source, target, collate = _pair(architecture=architecture)
    batch = collate(_examples())
    before = context_correction_loss(translator, source, target, batch, LossWeights()).total.item()
    args = MoTTrainingArguments(str(tmp_path), max_steps=1, learning_rate=3e-3, per_device_train_batch_size=4,
                                use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
                         train_dataset=_examples(), data_collator=collate)
    trainer.train()
    after = context_correction_loss(translator, source, target, batch, LossWeights()).total.item()
    assert after < before
    assert "kv" in trainer.state.log_history[0] and "kl" in trainer.state.log_history[0]


def test_bf16_trains_and_runs_the_frozen_models_in_bf16(tmp_path):
    """`bf16=True` autocasts the whole loss, not only the translator's forward: the frozen models are most of the
    cost. A step must run (mixed dtypes in the mixture and the alignment once broke it) and move the weights."""
    translator, source, target, collate = _pair()
    start = {name: p.detach().clone() for name, p in translator.named_parameters()}
    seen = set()
    hook = target.lm_head.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    args = MoTTrainingArguments(str(tmp_path), max_steps=1, learning_rate=1e-2, per_device_train_batch_size=2,
                                bf16=True, use_cpu=True, save_strategy="no", logging_steps=1)
    MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
               train_dataset=_examples(), data_collator=collate).train()
    hook.remove()
    assert seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in translator.parameters())
    assert any(not torch.equal(p.detach(), start[name]) for name, p in translator.named_parameters())


@pytest.mark.parametrize("capability, warned", [("AVX2", True), ("AVX512", False)])
def test_bf16_on_a_cpu_without_avx512_warns(tmp_path, monkeypatch, capability, warned):
    """bf16 autocast on an AVX2 CPU is several times slower than fp32 (a run here made no step in 9 min): the
    trainer says so and how to fix it, and stays quiet where the CPU has a bf16 path. The CPU cannot be chosen
    in a test, so its reported capability is set."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    translator, source, target, collate = _pair()
    args = MoTTrainingArguments(str(tmp_path), max_steps=1, bf16=True, use_cpu=True, save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
                   train_dataset=_examples(), data_collator=collate)
    slow = [w for w in caught if "leave out --bf16" in str(w.message)]
    assert len(slow) == int(warned)


def test_gradient_accumulation_averages_the_micro_batches(tmp_path):
    """Two accumulated micro-batches of the same pair make the step of that pair alone (plain SGD, no clipping:
    the step is the gradient itself), not twice it."""
    pair = _examples()[:1]
    steps = {}
    for accumulation in (1, 2):
        translator, source, target, collate = _pair()
        start = {name: p.detach().clone() for name, p in translator.named_parameters()}
        args = MoTTrainingArguments(str(tmp_path / str(accumulation)), max_steps=1, learning_rate=1e-2,
                                    per_device_train_batch_size=1, gradient_accumulation_steps=accumulation,
                                    optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant", use_cpu=True,
                                    save_strategy="no", logging_steps=1)
        MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
                   train_dataset=pair * accumulation, data_collator=collate).train()
        steps[accumulation] = {name: p.detach() - start[name] for name, p in translator.named_parameters()}
    moved = [name for name, step in steps[1].items() if step.abs().max() > 0]
    assert moved, "the step moved nothing"
    for name in moved:
        assert torch.allclose(steps[2][name], steps[1][name], rtol=1e-4, atol=1e-8), name


def test_dataloader_workers_train_as_the_main_process_does(tmp_path):
    """With `dataloader_num_workers`, the pairs are tokenised and aligned in worker processes, off the step's
    critical path, and the batches (their alignment object included) cross over to the main process. The steps must
    be those of a run without workers, and the log must say how many context tokens a second the run read."""
    weights, logs = {}, {}
    for workers in (0, 2):
        translator, source, target, collate = _pair()
        args = MoTTrainingArguments(str(tmp_path / str(workers)), max_steps=2, learning_rate=1e-2,
                                    per_device_train_batch_size=2, dataloader_num_workers=workers, use_cpu=True,
                                    save_strategy="no", logging_steps=1, seed=3)
        trainer = MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
                             train_dataset=_examples(), data_collator=collate)
        trainer.train()
        weights[workers] = {name: p.detach().clone() for name, p in translator.named_parameters()}
        logs[workers] = [row for row in trainer.state.log_history if "loss" in row]
    for name, value in weights[0].items():
        assert torch.allclose(weights[2][name], value, atol=1e-6), name
    assert [row["loss"] for row in logs[2]] == pytest.approx([row["loss"] for row in logs[0]], rel=1e-5)
    assert len(logs[2]) == 2 and all(row["context_tokens_per_second"] > 0 for row in logs[2])


def test_corpus_split_is_by_document_and_disjoint():
    docs = [f"document number {i} " + "word " * 60 for i in range(200)]
    splits = [document_split(d, 10) for d in docs]
    assert 5 < splits.count("validation") < 40
    train = ContextContinuationDataset("train", max_chunks=300)
    validation = ContextContinuationDataset("validation")
    assert len(validation) >= 200
    assert not {e["context"] for e in train.examples} & {e["context"] for e in validation.examples}


def test_chunks_are_contiguous_text():
    import random

    words = " ".join(f"w{i}" for i in range(100))
    chunks = cut_chunks(words, random.Random(0), (10, 20), 5)
    assert chunks and all(len(c["continuation"].split()) == 5 for c in chunks)
    first = chunks[0]
    assert words.startswith(first["context"] + first["continuation"])


def test_recall_pairs_repeat_a_span_of_their_context():
    plain = ContextContinuationDataset("validation", context_words=(20, 40), continuation_words=8, seed=3)
    mixed = ContextContinuationDataset(
        "validation", context_words=(20, 40), continuation_words=8, recall_fraction=0.5, seed=3
    )
    recall = [e for e in mixed.examples if e.get("recall")]
    assert 0.3 * len(mixed) < len(recall) < 0.7 * len(mixed)
    assert [e["context"] for e in mixed.examples] == [e["context"] for e in plain.examples]
    for example in recall:
        assert len(example["continuation"].split()) == 8
        assert example["continuation"].strip() in example["context"]
    with pytest.raises(ValueError, match="recall_fraction"):
        ContextContinuationDataset("validation", recall_fraction=1.5)


def test_question_pairs_ask_for_the_span_after_a_cue_from_their_context():
    options = {"context_words": (20, 40), "continuation_words": 8, "seed": 3}
    recall_only = ContextContinuationDataset("validation", recall_fraction=0.3, **options)
    both = ContextContinuationDataset("validation", recall_fraction=0.3, question_fraction=0.4, **options)
    # Adding question pairs leaves the recall pairs (and every context) as they were.
    recall = [e for e in both.examples if e.get("recall")]
    assert recall == [e for e in recall_only.examples if e.get("recall")]
    questions = [e for e in both.examples if e.get("question")]
    assert 0.25 * len(both) < len(questions) < 0.55 * len(both)
    for example in questions:
        found = re.fullmatch(r'\n\nQuestion: In the text above, what comes after "(.+)"\?\nAnswer: (.+)',
                             example["continuation"])
        assert found, example["continuation"]
        cue, answer = found.groups()
        assert len(cue.split()) == 4 and len(answer.split()) == 8
        assert f"{cue} {answer}" in example["context"]
    with pytest.raises(ValueError, match="add up to at most 1"):
        ContextContinuationDataset("validation", recall_fraction=0.6, question_fraction=0.6)


def test_retrieval_pairs_replace_a_share_and_reach_past_one_document():
    options = {"context_words": (160, 640), "continuation_words": 16, "recall_fraction": 0.3, "seed": 5}
    plain = ContextContinuationDataset("train", **options)
    mixed = ContextContinuationDataset("train", retrieval_fraction=0.25, retrieval_context_words=(1500, 2000),
                                       **options)
    assert len(mixed) == len(plain)
    replaced = [i for i, e in enumerate(mixed.examples) if e["corpus"] == "retrieval"]
    assert len(replaced) == round(0.25 * len(plain))
    # The rest are the same pairs at the same places.
    kept = sorted(set(range(len(plain))) - set(replaced))
    assert [mixed.examples[i] for i in kept] == [plain.examples[i] for i in kept]
    facts = 0
    for index in replaced:
        example = mixed.examples[index]
        words = len(example["context"].split())
        # Longer than all but a few training documents; a fact sentence adds up to seven words.
        assert 1500 <= words <= 2010 and example["question"]
        found = re.fullmatch(r"\n\nQuestion: (.+)\nAnswer: (.+)", example["continuation"])
        if found and not found.group(1).startswith("In the text above"):
            facts += 1
            # The made-up fact sentence, inserted into the context, carries the answer.
            assert found.group(2) in example["context"]
    assert 0.3 * len(replaced) < facts < 0.7 * len(replaced)
    assert not {mixed.examples[i]["context"] for i in replaced} & {
        e["context"] for e in ContextContinuationDataset("validation", **options).examples}
    with pytest.raises(ValueError, match="training split only"):
        ContextContinuationDataset("validation", retrieval_fraction=0.1)
    with pytest.raises(ValueError, match="retrieval_fraction"):
        ContextContinuationDataset("train", retrieval_fraction=-0.1)


# Training script runs in subprocesses, on tiny models saved to disk.

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, family, tokenizer, seed in (("src", "llama", char_tokenizer(), 1), ("tgt", "qwen2", bpe_tokenizer(), 2)):
        model = tiny_model(family, seed=seed)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def _script_args(tiny_dirs, out, steps, save_steps=2):
    return [
        "--source", str(tiny_dirs / "src"), "--target", str(tiny_dirs / "tgt"), "--output-dir", str(out),
        "--max-steps", str(steps), "--save-steps", str(save_steps), "--batch-size", "2", "--hidden-size", "16",
        "--expert-hidden-size", "16", "--context-words", "4", "8", "--continuation-words", "3",
        "--max-train-chunks", "32", "--logging-steps", "1", "--warmup-steps", "0",
    ]


def _run(args, env=None, **kwargs):
    return subprocess.run(args, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600,
                          **kwargs)


def test_kill_and_resume_gives_the_weights_of_an_uninterrupted_run(tiny_dirs, tmp_path):
    script = [sys.executable, "-m", "hf_mot.training.train"]
    steps = 30
    straight = _run(script + _script_args(tiny_dirs, tmp_path / "straight", steps) + ["--keep-checkpoints", "0"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert len(list((tmp_path / "straight").glob("checkpoint-*"))) == steps // 2

    # SIGKILL (no clean-up possible) once the second checkpoint is complete, well before the last step.
    killed_dir = tmp_path / "killed"
    process = subprocess.Popen(script + _script_args(tiny_dirs, killed_dir, steps),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (killed_dir / "checkpoint-4" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before checkpoint-4"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed_dir / "model.safetensors").exists()

    resumed = _run(script + _script_args(tiny_dirs, killed_dir, steps))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(killed_dir / "model.safetensors")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name
    assert (killed_dir / "loss_curve.png").is_file()
    kept = sorted(p.name for p in killed_dir.glob("checkpoint-*"))
    assert kept == [f"checkpoint-{steps - 2}", f"checkpoint-{steps}"]


def test_init_from_widens_a_mixture_only_and_interpolates_back(tiny_dirs, tmp_path):
    script = [sys.executable, "-m", "hf_mot.training.train"]
    first = _run(script + _script_args(tiny_dirs, tmp_path / "narrow", 1, save_steps=1))
    assert first.returncode == 0, first.stderr[-3000:]
    args = _script_args(tiny_dirs, tmp_path / "wide", 1, save_steps=1)
    args[args.index("--hidden-size") + 1] = "24"
    wide = _run(script + args + ["--init-from", str(tmp_path / "narrow")])
    assert wide.returncode == 0, wide.stderr[-3000:]
    config = MoTTranslator.from_pretrained(tmp_path / "wide").config
    assert (config.hidden_size, config.expert_hidden_size) == (24, 16)
    args[args.index("--hidden-size") + 1] = "8"
    narrowed = _run(script + args + ["--init-from", str(tmp_path / "narrow"), "--no-resume"])
    assert narrowed.returncode == 2 and "widened, not narrowed" in narrowed.stderr
    assert MoTTranslator.from_pretrained(tmp_path / "wide").config.hidden_size == 24  # nothing was written
    # Maps that read the target's residual stream are fitted by fit-layers; this trainer does not compute it.
    conditioned = with_dedicated_layers(MoTTranslator.from_pretrained(tmp_path / "narrow"), [2], [0],
                                        key_norm=False, bottom_layers=1,
                                        target_config=AutoConfig.from_pretrained(tiny_dirs / "tgt"))
    conditioned.save_pretrained(tmp_path / "conditioned")
    refused = _run(script + _script_args(tiny_dirs, tmp_path / "from_conditioned", 1)
                   + ["--init-from", str(tmp_path / "conditioned")])
    assert refused.returncode == 2 and "fit-layers --bottom-layers" in refused.stderr
    assert not (tmp_path / "from_conditioned" / "model.safetensors").exists()
    per_layer = _run(script + _script_args(tiny_dirs, tmp_path / "per_layer", 1, save_steps=1)
                     + ["--architecture", "per_layer"])
    assert per_layer.returncode == 0, per_layer.stderr[-3000:]
    # The per-layer baseline has no mixture to widen: a usage error that says what to leave out.
    args = _script_args(tiny_dirs, tmp_path / "per_layer_wide", 1, save_steps=1)
    args[args.index("--hidden-size") + 1] = "24"
    widen_per_layer = _run(script + args + ["--init-from", str(tmp_path / "per_layer")])
    assert widen_per_layer.returncode == 2 and "Leave out --hidden-size" in widen_per_layer.stderr
    assert not (tmp_path / "per_layer_wide" / "model.safetensors").exists()

    # scripts/interpolate_translator.py rebuilds the wide run's start (the narrow one widened with the run's
    # seed) and mixes: alpha 0 is that start, 1 the run, 0.5 halfway.
    interpolate = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "interpolate_translator.py"),
                   "--start", str(tmp_path / "narrow"), "--run", str(tmp_path / "wide")]
    start = widen_translator(MoTTranslator.from_pretrained(tmp_path / "narrow"), 24, 16, seed=0).state_dict()
    run = MoTTranslator.from_pretrained(tmp_path / "wide").state_dict()
    for alpha in ("0", "0.5", "1"):
        mixed = _run(interpolate + ["--alpha", alpha, "--output-dir", str(tmp_path / f"mix{alpha}")])
        assert mixed.returncode == 0, mixed.stderr[-3000:]
        weights = MoTTranslator.from_pretrained(tmp_path / f"mix{alpha}").state_dict()
        for name, value in weights.items():
            expected = float(alpha) * run[name] + (1 - float(alpha)) * start[name]
            assert torch.allclose(value, expected, atol=1e-6), (alpha, name)
    assert any(not torch.equal(start[name], run[name]) for name in run)  # the run did move its start


def test_interpolation_averages_the_checkpoints_of_one_run(tiny_dirs, tmp_path):
    script = [sys.executable, "-m", "hf_mot.training.train"]
    base = _run(script + _script_args(tiny_dirs, tmp_path / "base", 1, save_steps=1))
    assert base.returncode == 0, base.stderr[-3000:]
    run = _run(script + _script_args(tiny_dirs, tmp_path / "run", 2, save_steps=1)
               + ["--init-from", str(tmp_path / "base"), "--keep-checkpoints", "0"])
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoints = [tmp_path / "run" / f"checkpoint-{step}" for step in (1, 2)]
    interpolate = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "interpolate_translator.py"),
                   "--start", str(tmp_path / "base"), "--alpha", "0.5", "--run", *map(str, checkpoints)]
    mixed = _run(interpolate + ["--output-dir", str(tmp_path / "mean")])
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    start, *states = (MoTTranslator.from_pretrained(p).state_dict() for p in [tmp_path / "base", *checkpoints])
    weights = MoTTranslator.from_pretrained(tmp_path / "mean").state_dict()
    for name, value in weights.items():
        expected = 0.5 * (states[0][name] + states[1][name]) / 2 + 0.5 * start[name]
        assert torch.allclose(value, expected, atol=1e-6), name
    assert any(not torch.equal(states[0][name], states[1][name]) for name in start)
    record = json.loads((tmp_path / "mean" / "interpolation.json").read_text())
    assert record["run"] == str(tmp_path / "run") and len(record["runs"]) == 2  # the card reads the run's phases
    other_run = _run(interpolate + [str(tmp_path / "base"), "--output-dir", str(tmp_path / "bad")])
    assert other_run.returncode == 2 and "one run" in other_run.stderr and not (tmp_path / "bad").exists()


def test_qa_evaluation_keeps_the_best_checkpoint(tiny_dirs, tmp_path):
    """`--qa-eval-examples` with `--load-best-model-at-end --metric-for-best-model qa_f1`: every evaluation is logged,
    and the run ends on the best checkpoint, not the last. The tiny target answers nothing (F1 0 throughout), so
    the first evaluated checkpoint stays the best and its weights, not the last step's, are the run's."""
    script = [sys.executable, "-m", "hf_mot.training.train"]
    out = tmp_path / "run"
    run = _run(script + _script_args(tiny_dirs, out, 4) + [
        "--qa-eval-examples", "2", "--qa-eval-context-words", "20", "30", "--eval-strategy", "steps",
        "--eval-steps", "2", "--load-best-model-at-end", "--metric-for-best-model", "qa_f1", "--keep-checkpoints",
        "0", "--learning-rate", "3e-3"])
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    evaluations = [row for row in state["log_history"] if "eval_qa_f1" in row]
    assert [row["step"] for row in evaluations] == [2, 4]
    assert all(row["eval_native_f1"] == 0 and "eval_qa_retention" not in row for row in evaluations)
    assert state["best_model_checkpoint"].endswith("checkpoint-2")
    final, best, last = (load_file(path / "model.safetensors") for path in
                         (out, out / "checkpoint-2", out / "checkpoint-4"))
    assert all(torch.equal(final[name], best[name]) for name in final)
    assert any(not torch.equal(final[name], last[name]) for name in final)


def test_evaluate_answers_from_the_translated_cache_at_recompute_zero(smollm2, gemma3, tmp_path):
    """`MoTTrainer.evaluate()` scores what `evaluate_qa` scores for the same translator at recompute=0 (the
    shipped translator's own default is higher), reads each context natively once, and leaves the translator
    in training mode."""
    from hf_mot.evaluation.qa import evaluate_qa, summarize_qa
    from hf_mot.evaluation.tasks import synthetic_qa_examples

    (source, source_tok), (target, target_tok) = smollm2, gemma3
    translator = MoTTranslator.from_pretrained("hf-mot/smollm2-135m-to-gemma3-270m")
    assert translator.config.recompute > 0
    examples = synthetic_qa_examples(4, seed=5)
    trainer = MoTTrainer(model=translator, args=MoTTrainingArguments(str(tmp_path), use_cpu=True, report_to="none"),
                         source_model=source, target_model=target, train_dataset=[], eval_dataset=examples,
                         source_tokenizer=source_tok, target_tokenizer=target_tok)
    translator.train()
    metrics = trainer.evaluate()
    assert translator.training and len(trainer._native_scores) == 4
    rows = evaluate_qa(examples, translator=translator.eval(), source_model=source, source_tokenizer=source_tok,
                       target_model=target, target_tokenizer=target_tok, conditions={"r0": {"recompute": 0.0}},
                       progress=False)
    expected = summarize_qa(rows, ["r0"])
    assert metrics["eval_qa_f1"] == pytest.approx(expected["r0"]["score"])
    assert metrics["eval_native_f1"] == pytest.approx(expected["native"]["score"])
    assert expected["native"]["score"] > 0
    assert metrics["eval_qa_retention"] == pytest.approx(expected["r0"]["retention"])
    assert metrics["eval_qa_found"] == pytest.approx(expected["r0"]["found"])
    assert metrics["eval_native_found"] == pytest.approx(expected["native"]["found"])
    assert trainer.evaluate() == metrics
    assert [row["step"] for row in trainer.state.log_history if "eval_qa_f1" in row] == [0, 0]


def test_qa_evaluation_refuses_what_it_cannot_score(tmp_path, tiny_dirs):
    from hf_mot.evaluation.tasks import boolq_examples, needle_check_examples

    source, target = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=char_tokenizer(),
                                   target_tokenizer=bpe_tokenizer(), hidden_size=16, expert_hidden_size=16)
    args = MoTTrainingArguments(str(tmp_path), use_cpu=True)
    common = dict(model=MoTTranslator(config), args=args, source_model=source, target_model=target,
                  train_dataset=[])
    with pytest.raises(TypeError, match="extractive `QAExample`s"):
        MoTTrainer(**common, eval_dataset=boolq_examples(2), source_tokenizer=char_tokenizer(),
                   target_tokenizer=bpe_tokenizer())
    with pytest.raises(ValueError, match="pass `source_tokenizer` and `target_tokenizer`"):
        MoTTrainer(**common, eval_dataset=needle_check_examples(1))


def test_needle_checks_come_from_the_validation_split_between_sentences():
    from hf_mot.evaluation.tasks import needle_check_examples

    examples = needle_check_examples(12, context_words=(200, 600), seed=3)
    assert examples == needle_check_examples(12, context_words=(200, 600), seed=3)
    validation = [" ".join(d.split()) for docs in training_documents().values() for d in docs
                  if document_split(d, 5) == "validation"]
    found = 0
    for example in examples:
        fact = next(s for s in re.split(r"(?<=[.!?]) ", example.context)
                    if example.answers[0] in s and " ".join(s.split()[:2]) in example.question)
        before, after = example.context.split(fact)
        assert before == "" or before.endswith((". ", "! ", "? "))
        assert 200 <= example.meta["words"] <= 600
        # The words after the fact are a validation document's (a few may run across two documents).
        found += any(" ".join(after.split()[:8]) in d for d in validation)
    assert found >= 10


def test_fresh_learning_rate_trains_only_the_added_paths_when_the_rest_is_frozen(tiny_dirs, tmp_path):
    """`--init-from` with added paths and `--fresh-learning-rate`: the added parameters get a group of their own.
    With `--learning-rate 0` only they may move; the loaded weights stay exactly as they were."""
    script = [sys.executable, "-m", "hf_mot.training.train"]
    first = _run(script + _script_args(tiny_dirs, tmp_path / "base", 1, save_steps=1)
                 + ["--no-target-tokens", "--depth-matched-layers", "0"])
    assert first.returncode == 0, first.stderr[-3000:]
    args = _script_args(tiny_dirs, tmp_path / "added", 2, save_steps=2)
    args[args.index("--max-train-chunks") + 1] = "8"
    added = _run(script + args + ["--init-from", str(tmp_path / "base"), "--depth-matched-layers", "1",
                                  "--learning-rate", "0", "--fresh-learning-rate", "1e-2"])
    assert added.returncode == 0, added.stderr[-3000:]
    before, after = (load_file(tmp_path / run / "model.safetensors") for run in ("base", "added"))
    paths = {f"{mixture}.{name}" for mixture in ("key_mixture", "value_mixture")
             for name in ("depth_matched.weight", "depth_matched.bias", "target_tokens.norm_weight",
                          "target_tokens.norm_bias", "target_tokens.proj_weight", "target_tokens.proj_bias")}
    assert set(after) - set(before) == paths
    for name in before:
        assert torch.equal(before[name], after[name]), name
    for name in ("depth_matched.weight", "target_tokens.proj_weight"):  # both start at zero
        assert after[f"value_mixture.{name}"].abs().sum() > 0, f"{name} did not learn"
    scratch = _run(script + _script_args(tiny_dirs, tmp_path / "scratch", 1) + ["--fresh-learning-rate", "1e-2"])
    assert scratch.returncode == 2 and "--init-from" in scratch.stderr


def test_train_only_freezes_every_other_parameter(tiny_dirs, tmp_path):
    script = [sys.executable, "-m", "hf_mot.training.train"]
    first = _run(script + _script_args(tiny_dirs, tmp_path / "base", 1, save_steps=1))
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "base" / "README.md").write_text("---\nlicense: mit\n---\n# The start's own card\n")
    start = ["--init-from", str(tmp_path / "base")]
    only = ["--train-only", "value_mixture.out_proj"]
    part = _run(script + _script_args(tiny_dirs, tmp_path / "part", 2) + start + only)
    assert part.returncode == 0, part.stderr[-3000:]
    before, after = (load_file(tmp_path / run / "model.safetensors") for run in ("base", "part"))
    assert set(before) == set(after)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved == {"value_mixture.out_proj.weight", "value_mixture.out_proj.bias"}
    # The run does not pass the start's card (its training and figures) off as its own.
    assert "The start's own card" not in (tmp_path / "part" / "README.md").read_text()
    none = _run(script + _script_args(tiny_dirs, tmp_path / "none", 1) + start + ["--train-only", "no_such_path"])
    assert none.returncode == 2 and "matches none of the translator's parameters" in none.stderr


def test_fresh_parameters_must_be_the_translators():
    translator, source, target, collate = _pair()
    args = MoTTrainingArguments("unused", max_steps=1, use_cpu=True, fresh_learning_rate=1e-2)
    with pytest.raises(ValueError, match="fresh_parameters"):
        MoTTrainer(model=translator, args=args, source_model=source, target_model=target,
                   train_dataset=[], data_collator=collate, fresh_parameters=["no.such.weight"])


def test_two_processes_train_as_one(tiny_dirs, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo on the CPU): both ranks train one model together."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    script = str(Path(__file__).parents[1] / "examples" / "training" / "train_translator.py")
    # Plain SGD: Adam's first steps move every weight by about the learning rate whatever the gradient's size, so
    # they would hide whether the two ranks' gradients were averaged.
    sgd = ["--optim", "sgd", "--learning-rate", "0.05"]
    result = _run(launch + [script] + _script_args(tiny_dirs, tmp_path / "ddp", 3, save_steps=3) + sgd)
    assert result.returncode == 0, result.stderr[-3000:]
    # The same steps in one process with both ranks' batches in one (2 x 2 pairs): each rank gets every other batch
    # of the same seeded order, and DDP averages their gradients. A run at learning rate 0 is the start.
    runs = {"ddp": None}
    for name, extra in (("single", []), ("start", ["--learning-rate", "0"])):
        args = _script_args(tiny_dirs, tmp_path / name, 3, save_steps=3) + sgd + extra
        args[args.index("--batch-size") + 1] = "4"
        runs[name] = _run([sys.executable, "-m", "hf_mot.training.train"] + args)
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    ddp, single, start = (torch.cat([v.flatten() for v in load_file(tmp_path / run / "model.safetensors").values()])
                          for run in runs)
    # Each rank means its loss over its own pairs' tokens, one process over all four pairs': the runs differ by
    # that weighting (7% of the distance moved, measured). Ranks that train alone, each on all the data, as they
    # did when the arguments did not say CPU under torchrun, end 28% away.
    assert (ddp - start).norm() > 0.5 * (single - start).norm() > 0
    assert (ddp - single).norm() < 0.15 * (single - start).norm()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--output-dir", None], "--output-dir is required"),
        (["--context-words", "4"], "--context-words takes MIN MAX"),
        (["--context-words", "9", "4"], "--context-words takes MIN MAX"),
        (["--retrieval-context-words", "10", "400"], "--retrieval-context-words takes MIN MAX"),
        (["--retrieval-fraction", "1.5"], "--retrieval-fraction is a share of the pairs"),
        (["--gradient-accumulation-steps", "0"], "`gradient_accumulation_steps` must be 1 or more"),
        (["--kv-weight", "-1"], "Loss weights must be 0 (off) or more"),
        (["--time-budget-minutes", "0"], "`time_budget_minutes` must be more than 0"),
        (["--fresh-learning-rate", "1e-3"], "--fresh-learning-rate is for the paths added to an --init-from"),
        (["--architecture", "moe"], "invalid choice"),
    ],
)
def test_train_usage_errors_name_the_option(tmp_path, capsys, extra, message):
    """`hf-mot train` refuses bad options with a usage error (exit 2) that names them, before loading any model."""
    from hf_mot.training.train import build_parser, parse

    argv = ["--source", "a", "--target", "b", "--output-dir", str(tmp_path / "out")]
    if extra[1:] == [None]:
        argv = argv[:4]
    else:
        argv += extra
    with pytest.raises(SystemExit) as exit_info:
        parse(build_parser(), argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_options_are_declared_once():
    """Every loss weight and run option `hf-mot train` takes comes from one dataclass field: the CLI's defaults are
    the dataclasses' (or `TRAIN_DEFAULTS`), and the old spellings still parse."""
    from hf_mot.training.train import TRAIN_DEFAULTS, build_parser, parse

    model_args, data_args, training_args = parse(build_parser(), [
        "--source", "a", "--target", "b", "--output-dir", "x", "--batch-size", "3", "--keep-checkpoints", "0",
        "--no-resume", "--kl-first-weight", "4", "--context-words", "8", "16",
    ])
    assert training_args.per_device_train_batch_size == 3 and training_args.save_total_limit == 0
    assert training_args.kl_first_weight == 4 and training_args.kv_weight == LossWeights().kv_weight
    assert not model_args.resume and data_args.context_words == [8, 16]
    assert training_args.learning_rate == TRAIN_DEFAULTS["learning_rate"]
    assert training_args.lr_scheduler_type == "cosine"


def test_a_pair_trained_here_translates_better_than_untrained(tmp_path):
    """Behaviour, not shapes: a tiny Llama -> Gemma 3 pair (different tokenizers) trained here for 60 steps moves the
    target's next-token distributions after the translated cache toward its own reading of the context, on held-out
    text: half the KL of the untrained translator and a much higher top-1 agreement."""
    from hf_mot.evaluation import FidelityExample, evaluate_fidelity, summarize

    words = "the a cat dog runs sits on in under tree house river blue red green small big old new and then".split()

    def texts(seed, count):
        rng = random.Random(seed)
        return [" ".join(rng.choice(words) for _ in range(14)) for _ in range(count)]

    source, target = tiny_model("llama", seed=1), tiny_model("gemma3", seed=2)
    source_tok, target_tok = char_tokenizer(), bpe_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=source_tok,
                                   target_tokenizer=target_tok, hidden_size=32, expert_hidden_size=32)
    torch.manual_seed(0)
    untrained, trained = MoTTranslator(config).eval(), MoTTranslator(config)
    trained.load_state_dict(untrained.state_dict())
    held_out = [FidelityExample(t[:50], target_tok(t[50:70], add_special_tokens=False).input_ids, 0, "test")
                for t in texts(2, 12)]

    def fidelity(translator):
        rows = evaluate_fidelity(held_out, translator=translator.eval(), source_model=source,
                                 source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok,
                                 conditions={"full": {}}, progress=False)
        return summarize(rows, ["full"])["full"]

    before = fidelity(untrained)
    args = MoTTrainingArguments(str(tmp_path), max_steps=60, learning_rate=3e-3, per_device_train_batch_size=8,
                                use_cpu=True, save_strategy="no", logging_steps=20)
    MoTTrainer(model=trained, args=args, source_model=source, target_model=target,
               train_dataset=[{"context": t[:50], "continuation": t[50:]} for t in texts(1, 64)],
               data_collator=MoTDataCollator(source_tok, target_tok)).train()
    after = fidelity(trained)
    assert after["kl"] < 0.6 * before["kl"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"] + 0.15, (before, after)
