"""NMT data: number corpus, parallel files, SentencePiece and the bucketed pipeline."""

import logging
import os
import re

import numpy as np
import pytest
import sentencepiece

from tfdist.data import nmt

MAX_TOKENS, BATCH_MULTIPLE, MAX_LENGTH, WIDTH = 256, 4, 32, 8


@pytest.fixture(scope="module")
def corpus():
    return nmt.number_corpus("de", num_train=2000, num_test=100, max_number=100_000)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    texts = [s for pair in corpus.train for s in pair]
    return nmt.train_tokenizer(texts, str(tmp_path_factory.mktemp("spm") / "spm"), vocab_size=100)


# --- Number corpus -----------------------------------------------------------------------


def test_held_out_numbers_are_disjoint_and_deterministic(corpus):
    assert len(corpus.train_numbers) == 2000 and len(corpus.test_numbers) == 100
    assert not set(corpus.train_numbers) & set(corpus.test_numbers)
    assert len(set(corpus.train_numbers)) == 2000 and len(set(corpus.test_numbers)) == 100
    assert all(0 <= n < 100_000 for n in corpus.train_numbers + corpus.test_numbers)
    again = nmt.number_corpus("de", num_train=2000, num_test=100, max_number=100_000)
    assert again == corpus
    # The held-out set depends on the seed but not on the training size.
    smaller = nmt.number_corpus("de", num_train=50, num_test=100, max_number=100_000)
    assert smaller.test_numbers == corpus.test_numbers
    assert not set(smaller.train_numbers) & set(corpus.test_numbers)
    other = nmt.number_corpus("de", num_train=50, num_test=100, max_number=100_000, seed=1)
    assert other.test_numbers != corpus.test_numbers


def test_every_number_fits_when_asked_for_all():
    corpus = nmt.number_corpus("de", num_train=25, num_test=5, max_number=30)
    assert sorted(corpus.train_numbers + corpus.test_numbers) == list(range(30))


@pytest.mark.parametrize("lang, expected", [
    ("de", {0: "null", 7: "sieben", 21: "einundzwanzig", 16: "sechzehn", 30: "dreißig"}),
    ("fr", {0: "zéro", 7: "sept", 21: "vingt et un", 16: "seize", 30: "trente"}),
])
def test_known_numbers(lang, expected):
    corpus = nmt.number_corpus(lang, num_train=31, num_test=0, max_number=31)
    table = dict(zip(corpus.train_numbers, corpus.train))
    english = {0: "zero", 7: "seven", 21: "twenty-one", 16: "sixteen", 30: "thirty"}
    for number, target in expected.items():
        assert table[number] == (english[number], target)
    assert corpus.target_lang == lang


def test_corpus_errors():
    with pytest.raises(ValueError, match=r"target_lang='es'.*\('de', 'fr'\)"):
        nmt.number_corpus("es")
    with pytest.raises(ValueError, match="num_train=20, num_test=20, max_number=30"):
        nmt.number_corpus("de", num_train=20, num_test=20, max_number=30)


# --- Parallel files ------------------------------------------------------------------------


def test_read_parallel(tmp_path):
    (tmp_path / "a.en").write_bytes(b"one\r\ntwenty-one\nthree\tthree")
    (tmp_path / "a.de").write_text("eins\neinundzwanzig\ndrei  \n", encoding="utf-8")
    assert nmt.read_parallel(str(tmp_path / "a.en"), str(tmp_path / "a.de")) == [
        ("one", "eins"), ("twenty-one", "einundzwanzig"), ("three\tthree", "drei  ")]


def test_read_parallel_errors(tmp_path):
    src, tgt, missing = tmp_path / "b.en", tmp_path / "b.de", str(tmp_path / "nope.de")
    src.write_text("one\ntwo\nthree\n")
    tgt.write_text("eins\nzwei\n")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        nmt.read_parallel(str(src), missing)
    with pytest.raises(ValueError) as info:
        nmt.read_parallel(str(src), str(tgt))
    assert all(part in str(info.value) for part in (str(src), str(tgt), "has 3", "has 2"))
    tgt.write_text("eins\n\ndrei\n")
    with pytest.raises(ValueError, match=re.escape(f"{tgt}:2: empty line")):
        nmt.read_parallel(str(src), str(tgt))


def test_read_tsv(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("one\teins\r\nfive hundred\tfünfhundert\n", encoding="utf-8")
    assert nmt.read_tsv(str(path)) == [("one", "eins"), ("five hundred", "fünfhundert")]


@pytest.mark.parametrize("content, line, tabs", [
    ("one\teins\ntwo zwei\n", 2, 0), ("one\teins\tuno\n", 1, 2), ("\tnull\n", 1, 1)])
def test_read_tsv_bad_lines(tmp_path, content, line, tabs):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}:") + f".*got {tabs} tabs"):
        nmt.read_tsv(str(path))


def test_read_tsv_missing_and_empty_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        nmt.read_tsv(str(tmp_path / "nope.tsv"))
    (tmp_path / "e.tsv").write_text("one\teins\n   \n")
    with pytest.raises(ValueError, match=r"e\.tsv:2: empty line"):
        nmt.read_tsv(str(tmp_path / "e.tsv"))


# --- Tokenizer -----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_fixed_ids(corpus, tokenizer):
    assert tokenizer.vocab_size == 104  # 100 rounded up to a multiple of 8
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    texts = [s for pair in corpus.train + corpus.test for s in pair]
    encoded = tokenizer.encode_batch(texts)
    assert encoded[0] == tokenizer.encode(texts[0])
    assert all(ids and min(ids) > nmt.UNK_ID and max(ids) < 104 for ids in encoded)
    assert tokenizer.decode_batch(encoded) == texts
    ids = tokenizer.encode("twenty-one")
    assert tokenizer.decode([1] + ids + [2, 0, 0]) == "twenty-one"
    assert tokenizer.decode(ids + [2] + tokenizer.encode("three")) == "twenty-one"
    assert tokenizer.decode(np.array([0, 0], np.int32)) == ""


def test_tokenizer_is_deterministic_and_loads(corpus, tokenizer, tmp_path):
    texts = [s for pair in corpus.train for s in pair]
    again = nmt.train_tokenizer(texts, str(tmp_path / "again"), vocab_size=100)
    loaded = nmt.load_tokenizer(tokenizer.path)
    pieces = lambda t: [t._sp.id_to_piece(i) for i in range(t.vocab_size)]
    assert pieces(again) == pieces(tokenizer) == pieces(loaded)


def test_bpe_and_vocab_multiple(corpus, tmp_path):
    texts = [s for pair in corpus.train[:500] for s in pair]
    bpe = nmt.train_tokenizer(texts, str(tmp_path / "bpe"), vocab_size=70, model_type="bpe",
                              vocab_multiple=16)
    assert bpe.vocab_size == 80
    assert bpe.decode_batch(bpe.encode_batch(texts)) == texts


def test_tokenizer_errors(corpus, tmp_path):
    texts = [s for pair in corpus.train[:200] for s in pair]
    with pytest.raises(ValueError) as info:
        nmt.train_tokenizer(texts, str(tmp_path / "big"), vocab_size=5000)
    limit = int(re.search(r"at most (\d+)", str(info.value)).group(1))
    assert "vocab_size=5000 (trained as 5000" in str(info.value)
    assert f"use vocab_size<={limit // 8 * 8}." in str(info.value)
    suggested = nmt.train_tokenizer(texts, str(tmp_path / "ok"), vocab_size=limit // 8 * 8)
    assert suggested.vocab_size == limit // 8 * 8
    with pytest.raises(ValueError, match="model_type='word'"):
        nmt.train_tokenizer(texts, str(tmp_path / "w"), model_type="word")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "none.model"))):
        nmt.load_tokenizer(str(tmp_path / "none.model"))
    # A model with SentencePiece's default ids (no pad, unk=0) is refused.
    with open(os.devnull, "w") as log:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(tmp_path / "plain"), vocab_size=40,
            model_type="bpe", logstream=log)
    with pytest.raises(ValueError, match=r"\(-1, 1, 2, 0\).*\(0, 1, 2, 3\)"):
        nmt.load_tokenizer(str(tmp_path / "plain.model"))


def test_round_vocab():
    assert [nmt.round_vocab(v, 8) for v in (1, 8, 9, 250, 256)] == [8, 8, 16, 256, 256]
    assert nmt.round_vocab(32000, 1) == 32000
    with pytest.raises(ValueError, match="multiple=0"):
        nmt.round_vocab(100, 0)


# --- Dataset -------------------------------------------------------------------------------


def test_bucket_batch_sizes():
    assert nmt.bucket_batch_sizes(256, 4, 32, 8) == {8: 32, 16: 16, 24: 8, 32: 8}
    assert nmt.bucket_batch_sizes(4096, 8, 64, 16) == {16: 256, 32: 128, 48: 80, 64: 64}
    with pytest.raises(ValueError, match="max_length=30.*multiple of bucket_width, e.g. 32"):
        nmt.bucket_batch_sizes(256, 4, 30, 8)
    with pytest.raises(ValueError, match="max_tokens=100.*>= batch_multiple \\* max_length = 128"):
        nmt.bucket_batch_sizes(100, 4, 32, 8)
    with pytest.raises(ValueError, match="batch_multiple=0"):
        nmt.bucket_batch_sizes(256, 0, 32, 8)


def _batches(dataset):
    return [tuple(np.asarray(t) for t in (s, d, y)) for (s, d), y in dataset]


def test_dataset_batches(corpus, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    pairs = corpus.train[:600]
    dataset = nmt.make_dataset(pairs, tokenizer, MAX_TOKENS, BATCH_MULTIPLE, MAX_LENGTH, WIDTH)
    spec = dataset.element_spec
    assert [s.dtype.name for s in (spec[0][0], spec[0][1], spec[1])] == ["int32"] * 3
    sizes = nmt.bucket_batch_sizes(MAX_TOKENS, BATCH_MULTIPLE, MAX_LENGTH, WIDTH)
    seen = []
    for source, decoder_input, target in _batches(dataset):
        batch, length = source.shape
        assert decoder_input.shape == target.shape == (batch, length)
        assert length % WIDTH == 0 and batch == sizes[length]
        assert batch * length <= MAX_TOKENS and batch % BATCH_MULTIPLE == 0
        # decoder input = bos + target tokens; target = target tokens + eos; pads are 0.
        assert (decoder_input[:, 0] == nmt.BOS_ID).all()
        shifted = np.where(target == nmt.EOS_ID, 0, target)[:, :-1]
        np.testing.assert_array_equal(decoder_input[:, 1:], shifted)
        for row in (source, target):
            size = (row != 0).sum(axis=1)
            assert (row[np.arange(batch), size - 1] == nmt.EOS_ID).all()
            assert ((np.arange(length) < size[:, None]) == (row != 0)).all()
        longest = np.maximum((source != 0).sum(1), (target != 0).sum(1))
        assert longest.max() > length - WIDTH  # the smallest bucket that fits
        assert (longest > length - WIDTH).all()
        seen += list(zip(tokenizer.decode_batch(source), tokenizer.decode_batch(target)))
    assert len(set(seen)) == len(seen) and set(seen) <= set(pairs)
    # Every bucket drops only its remainder.
    lengths = [max(len(tokenizer.encode(s)), len(tokenizer.encode(t))) + 1 for s, t in pairs]
    buckets = [-(-n // WIDTH) * WIDTH for n in lengths]
    assert len(seen) == sum(buckets.count(n) // b * b for n, b in sizes.items())
    assert f"({len(seen)} pairs) per epoch" in caplog.text


def test_dataset_is_deterministic(corpus, tokenizer):
    make = lambda seed, pairs=corpus.train[:400]: _batches(nmt.make_dataset(
        pairs, tokenizer, MAX_TOKENS, BATCH_MULTIPLE, MAX_LENGTH, WIDTH, seed=seed))
    first, again, other = make(0), make(0), make(1)
    assert len(first) == len(again)
    assert all((a == b).all() for x, y in zip(first, again) for a, b in zip(x, y))
    assert [x[0].shape for x in first] != [x[0].shape for x in other] or any(
        (x[0] != y[0]).any() for x, y in zip(first, other))


def test_dataset_repeats(corpus, tokenizer):
    dataset = nmt.make_dataset(corpus.train[:100], tokenizer, MAX_TOKENS, BATCH_MULTIPLE,
                               MAX_LENGTH, WIDTH, repeat=True)
    assert len(_batches(dataset.take(50))) == 50


def test_dataset_trains_a_keras_model(corpus, tokenizer):
    import keras
    source = keras.Input([None], dtype="int32")
    decoder_input = keras.Input([None], dtype="int32")
    embed = keras.layers.Embedding(tokenizer.vocab_size, 8)
    context = keras.ops.mean(embed(source), axis=1, keepdims=True)
    logits = keras.layers.Dense(tokenizer.vocab_size)(embed(decoder_input) + context)
    model = keras.Model([source, decoder_input], logits)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                     ignore_class=0))
    dataset = nmt.make_dataset(corpus.train[:400], tokenizer, MAX_TOKENS, BATCH_MULTIPLE,
                               MAX_LENGTH, WIDTH, repeat=True)
    history = model.fit(dataset, steps_per_epoch=5, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_long_pairs_are_dropped_and_counted(corpus, tokenizer, caplog):
    pairs = corpus.train[:300]
    too_long = sum(max(len(tokenizer.encode(s)), len(tokenizer.encode(t))) + 1 > 16
                   for s, t in pairs)
    assert 0 < too_long < len(pairs)
    encoded = nmt.encode_pairs(pairs, tokenizer, max_length=16)
    assert encoded.num_dropped == too_long and len(encoded.source) == len(pairs) - too_long
    caplog.set_level(logging.INFO, logger="absl")
    dataset = nmt.make_dataset(pairs, tokenizer, 64, 1, 16, WIDTH, shuffle=False)
    assert f"dropped {too_long} longer than max_length=16" in caplog.text
    batches = _batches(dataset)
    assert all(s.shape[1] <= 16 for s, _, _ in batches)
    assert sum(len(s) for s, _, _ in batches) <= len(pairs) - too_long
    with pytest.raises(ValueError, match="None of the 300 pairs fits max_length=1"):
        nmt.make_dataset(pairs, tokenizer, 64, 1, max_length=1, bucket_width=1)
    for repeat in (False, True):
        with pytest.raises(ValueError, match=r"no full batch: 1 pairs.*in \{8: 8\}"):
            nmt.make_dataset(pairs, tokenizer, 64, 8, max_length=8, repeat=repeat)


def test_eval_batches(corpus, tokenizer):
    sources = [s for s, _ in corpus.test[:23]]
    batches, count = nmt.make_eval_batches(sources, tokenizer, batch_size=8, max_length=MAX_LENGTH)
    assert count == 23 and len(batches) == 3
    for batch in batches:
        assert batch.dtype == np.int32 and batch.shape[0] == 8
        longest = (batch != 0).sum(axis=1).max()
        assert batch.shape[1] == -(-longest // WIDTH) * WIDTH
    decoded = [tokenizer.decode(row) for batch in batches for row in batch]
    assert decoded[:23] == sources and decoded[23:] == [""]
    assert (batches[-1][7:] == 0).all()
    assert all(row[(row != 0).sum() - 1] == nmt.EOS_ID for batch in batches for row in batch[:7])
    with pytest.raises(ValueError, match="Source 0 has .* max_length=4"):
        nmt.make_eval_batches(sources, tokenizer, 8, max_length=4)
