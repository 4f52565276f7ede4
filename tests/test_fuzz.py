"""Fuzzing with hypothesis: whatever text, batch or file comes in, the outcome is a valid cache or a documented
error (`ValueError`/`TypeError` whose message says what to do), never an internal exception or a wrong cache."""

import pytest
import torch
from conftest import bpe_tokenizer, char_tokenizer, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_mot import MoTConfig, MoTTranslator, TranslatedCache, translate_context
from hf_mot._compat import cache_kwarg

SOURCE, SOURCE_TOK = tiny_model("llama", seed=1), char_tokenizer()
TARGET, TARGET_TOK = tiny_model("gemma3", seed=2), bpe_tokenizer()
TRANSLATOR = MoTTranslator(MoTConfig.from_models(SOURCE.config, TARGET.config, source_tokenizer=SOURCE_TOK,
                                                 target_tokenizer=TARGET_TOK, hidden_size=16)).eval()
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any Unicode (emoji, CJK, combining marks, controls), runs of whitespace, and plain prose.
texts = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=" \t\n", max_size=5),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=120),
    st.sampled_from(["The cat sat.", "東京 🙂 naïve café", "a" * 150, "x"]),
    # Longer than a tiny model holds (512 positions) on one side or both.
    st.builds(lambda word, times: (word + " ") * times, st.sampled_from(["ab", "the", "東京"]), st.integers(100, 400)),
)


def _translate(contexts, **kwargs):
    return translate_context(contexts, translator=TRANSLATOR, source_model=SOURCE, source_tokenizer=SOURCE_TOK,
                             target_model=TARGET, target_tokenizer=TARGET_TOK, **kwargs)


@FUZZ
@given(contexts=st.one_of(texts, st.lists(texts, min_size=1, max_size=3)),
       recompute=st.one_of(st.none(), st.floats(0, 1), st.sampled_from([0.0, 1.0])))
def test_translate_and_generate_on_any_text(contexts, recompute):
    rows = [contexts] if isinstance(contexts, str) else contexts
    try:
        cache = _translate(contexts, recompute=recompute)
    except ValueError as error:
        message = str(error)
        # The documented refusals for text: empty or whitespace-only contexts, a recompute budget that leaves
        # nothing to translate, or a context longer than one of the models holds.
        assert any(not row.strip() for row in rows) and "empty or whitespace" in message \
            or "leaves nothing to translate" in message \
            or "tokens long but the" in message and "shorten the context" in message, message
        return
    assert isinstance(cache, TranslatedCache)
    lengths = [len(TARGET_TOK(row).input_ids) for row in rows]
    assert cache.attention_mask.sum(dim=1).tolist() == lengths
    assert cache.num_context_tokens == max(lengths) == cache.get_seq_length()
    for layer in cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    prompt = TARGET_TOK([" Answer:"] * len(rows), return_tensors="pt", add_special_tokens=False).input_ids
    out = TARGET.generate(input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]), max_new_tokens=2,
                          do_sample=False, **{cache_kwarg(TARGET): cache})
    assert out.shape == (len(rows), prompt.shape[1] + 2)


@FUZZ
@given(bad=st.one_of(st.integers(), st.binary(max_size=4), st.none(), st.lists(st.integers(), min_size=1, max_size=2),
                     st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)))
def test_context_of_any_wrong_type_is_a_type_error(bad):
    with pytest.raises((TypeError, ValueError), match="`context`"):
        _translate(bad)


@pytest.fixture(scope="module")
def saved_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "cache.safetensors"
    _translate(["A short context for the file.", "Another, a little longer, context."]).save(path)
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_corrupted_or_truncated_cache_files_load_or_say_why(saved_cache, tmp_path_factory, data):
    """Flipped bytes anywhere or a cut-off file: `TranslatedCache.load` returns a cache of the right shapes (a flip
    inside a tensor's data is not detectable) or raises a `ValueError` that names the file."""
    blob = bytearray(saved_cache)
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(blob) - 1), label="at")
            blob[at] ^= data.draw(st.integers(1, 255), label="xor")
    path = tmp_path_factory.mktemp("bad") / "cache.safetensors"
    path.write_bytes(bytes(blob))
    try:
        cache = TranslatedCache.load(path, TARGET.config)
    except ValueError as error:
        assert str(path) in str(error)
        return
    assert cache.attention_mask.shape[0] == 2
    assert len(cache.layers) == TARGET.config.num_hidden_layers
    for layer in cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_cli")
    for name, model, tokenizer in (("src", SOURCE, SOURCE_TOK), ("tgt", TARGET, TARGET_TOK)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    TRANSLATOR.save_pretrained(root / "translator")
    return root


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(context=texts, recompute=st.one_of(st.none(), st.floats(-1, 2), st.sampled_from([0.0, 1.0, float("nan")])),
       tail=st.sampled_from([None, 0, 3, 10_000]))
def test_the_cli_answers_or_says_why_in_one_line(cli_dirs, capsys, context, recompute, tail):
    """`hf-mot generate` on any context and dial setting: an answer and exit 0, or one `error:` line and exit 1."""
    from hf_mot.cli import main

    argv = ["generate", "--source", str(cli_dirs / "src"), "--target", str(cli_dirs / "tgt"), "--translator",
            str(cli_dirs / "translator"), "--context", context, "--max-new-tokens", "2"]
    if recompute is not None:
        # `--recompute=X`: argparse reads `--recompute -1e-05` as a missing value followed by an option.
        argv += [f"--recompute={recompute!r}"]
    if tail is not None:
        argv += ["--native-tail", str(tail)]
    if context.startswith("-"):  # argparse would read it as an option
        at = argv.index("--context")
        argv[at : at + 2] = [f"--context={context}"]
    code = main(argv)
    out, err = capsys.readouterr()
    if code == 0:
        assert out.startswith("answer: ") and "target's own answer" in out
    else:
        assert code == 1 and err.strip().splitlines()[-1].startswith("hf-mot generate: error: "), err
