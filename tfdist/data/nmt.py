"""Neural machine translation data: corpora, SentencePiece and a bucketed tf.data pipeline.

Shapes: B batch, L padded length. L is always a multiple of `bucket_width`, so a
dataset has at most `max_length / bucket_width` distinct batch shapes (few XLA
programs; MoE group sizes can divide `B * L`).

Corpora: `number_corpus` builds English number words -> German or French number
words with `num2words` (no network); `read_parallel` and `read_tsv` read text files.

Example:
    corpus = number_corpus("de", num_train=20_000)
    tokenizer = train_tokenizer([s for pair in corpus.train for s in pair],
                                "/tmp/nmt/spm", vocab_size=256)
    dataset = make_dataset(corpus.train, tokenizer, max_tokens=4096, batch_multiple=8)
    (source_ids, decoder_input_ids), target_ids = next(iter(dataset))  # int32 [B, L]
"""

import dataclasses
import os
import re
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

TARGET_LANGS = ("de", "fr")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
Pair = Tuple[str, str]


@dataclasses.dataclass(frozen=True)
class NumberCorpus:
    """English -> `target_lang` number words; `test_numbers` never occur in `train_numbers`.

    `train[i]` is `(num2words(train_numbers[i], lang="en"), num2words(..., lang=target_lang))`.
    """
    target_lang: str
    train: Tuple[Pair, ...]
    test: Tuple[Pair, ...]
    train_numbers: Tuple[int, ...]
    test_numbers: Tuple[int, ...]


def number_corpus(target_lang: str = "de", num_train: int = 20_000, num_test: int = 500,
                  max_number: int = 1_000_000, seed: int = 0) -> NumberCorpus:
    """Builds the English -> German/French number-words corpus.

    Numbers are drawn without replacement from `[0, max_number)`. The test numbers
    depend only on `(seed, max_number, num_test)`, so changing `num_train` keeps the
    held-out set. `num2words` is the cost: the default size takes about 8 s on one
    core (50k pairs about 18 s); nothing is cached on disk.

    Example:
        >>> corpus = number_corpus("de", num_train=30, num_test=0, max_number=30)
        >>> dict(zip(corpus.train_numbers, corpus.train))[21]
        ('twenty-one', 'einundzwanzig')

    Raises:
        ValueError: an unsupported `target_lang`, or more numbers asked than exist.
    """
    if target_lang not in TARGET_LANGS:
        raise ValueError(f"Unsupported target_lang={target_lang!r}; valid: {TARGET_LANGS}.")
    if num_train < 0 or num_test < 0 or num_train + num_test > max_number:
        raise ValueError(f"Received num_train={num_train}, num_test={num_test}, max_number="
                         f"{max_number}; need num_train, num_test >= 0 and num_train + "
                         "num_test <= max_number.")
    from num2words import num2words
    test_seq, train_seq = np.random.SeedSequence(seed).spawn(2)
    test = np.random.default_rng(test_seq).choice(max_number, num_test, replace=False)
    candidates = np.random.default_rng(train_seq).choice(
        max_number, num_train + num_test, replace=False)
    train = candidates[~np.isin(candidates, test)][:num_train]
    pairs = lambda ns: tuple((num2words(n, lang="en"), num2words(n, lang=target_lang))
                             for n in ns)
    train, test = tuple(int(n) for n in train), tuple(int(n) for n in test)
    return NumberCorpus(target_lang, pairs(train), pairs(test), train, test)


def _read_lines(path: str) -> List[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file: {path!r}.")
    with open(path, encoding="utf-8", newline="\n") as f:
        lines = [line.removesuffix("\n").removesuffix("\r") for line in f]
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{path}:{number}: empty line; every line must hold a sentence.")
    return lines


def read_parallel(src_path: str, tgt_path: str) -> List[Pair]:
    """Reads line-aligned source and target files (UTF-8) into `(source, target)` pairs.

    Line ends (`\\n`, `\\r\\n`) are stripped; nothing is skipped.

    Example:
        pairs = read_parallel("train.en", "train.de")

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: an empty line (named by file and line), or different line counts.
    """
    sources, targets = _read_lines(src_path), _read_lines(tgt_path)
    if len(sources) != len(targets):
        raise ValueError(f"{src_path!r} has {len(sources)} lines but {tgt_path!r} has "
                         f"{len(targets)}; parallel files must have one line per pair.")
    return list(zip(sources, targets))


def read_tsv(path: str) -> List[Pair]:
    """Reads `source<TAB>target` lines (UTF-8) into pairs.

    Example:
        pairs = read_tsv("train.en-de.tsv")

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: an empty line or side, or a line without exactly one tab.
    """
    pairs = []
    for number, line in enumerate(_read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise ValueError(f"{path}:{number}: expected 'source<TAB>target' with exactly one "
                             f"tab and two non-empty sides, got {len(fields) - 1} tabs: {line!r}.")
        pairs.append((fields[0], fields[1]))
    return pairs


class Tokenizer:
    """A SentencePiece model with fixed ids `pad=0, bos=1, eos=2, unk=3`.

    Example:
        tokenizer = load_tokenizer("/tmp/nmt/spm.model")
        ids = tokenizer.encode("twenty-one")   # no bos/eos
        tokenizer.decode(ids + [tokenizer.eos_id, 0, 0])  # 'twenty-one'
    """

    def __init__(self, path: str):
        import sentencepiece
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.vocab_size()
        self.pad_id, self.bos_id = self._sp.pad_id(), self._sp.bos_id()
        self.eos_id, self.unk_id = self._sp.eos_id(), self._sp.unk_id()
        ids = (self.pad_id, self.bos_id, self.eos_id, self.unk_id)
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(f"{path!r} has pad/bos/eos/unk ids {ids}; tfdist needs "
                             f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)} (train it with train_tokenizer).")

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes up to the first eos, ignoring pad and bos."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self._sp.decode([i for i in ids if i not in (self.pad_id, self.bos_id)])

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> List[str]:
        return [self.decode(ids) for ids in batch]


def load_tokenizer(path: str) -> Tokenizer:
    """Loads a `.model` file written by `train_tokenizer`; FileNotFoundError if missing."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No SentencePiece model at {path!r}.")
    return Tokenizer(path)


def round_vocab(vocab_size: int, multiple: int) -> int:
    """Rounds `vocab_size` up to a multiple of `multiple`: `round_vocab(250, 8) == 256`."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"Received vocab_size={vocab_size}, multiple={multiple}; "
                         "both must be >= 1.")
    return _round_up(vocab_size, multiple)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def train_tokenizer(texts: Iterable[str], model_prefix: str, vocab_size: int = 8000,
                    model_type: str = "unigram", vocab_multiple: int = 8,
                    seed: int = 0) -> Tokenizer:
    """Trains one SentencePiece model on source and target `texts`; writes `{model_prefix}.model`.

    The vocabulary is exactly `round_vocab(vocab_size, vocab_multiple)` pieces, so it
    shards evenly over `vocab_multiple` devices. Training is deterministic: it sets
    SentencePiece's (process-wide) random seed to `seed` and fixes the thread count.
    Every character of `texts` is kept (`character_coverage=1.0`), so
    `decode(encode(s)) == s` for NFKC-normal text with single spaces.

    Example:
        tokenizer = train_tokenizer(["one", "eins", ...], "/tmp/nmt/spm", vocab_size=250)
        tokenizer.vocab_size  # 256

    Raises:
        ValueError: a bad `model_type`, or a vocabulary too large for the corpus.
    """
    import sentencepiece
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"Unsupported model_type={model_type!r}; valid: ('unigram', 'bpe').")
    size = round_vocab(vocab_size, vocab_multiple)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    sentencepiece.set_random_generator_seed(seed)
    try:
        with open(os.devnull, "w") as log:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(texts), model_prefix=model_prefix, vocab_size=size,
                model_type=model_type, character_coverage=1.0, num_threads=16,
                pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, logstream=log)
    except RuntimeError as e:
        match = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)",
                          str(e))
        if not match:
            raise
        limit = int(match.group(2))
        raise ValueError(
            f"vocab_size={vocab_size} (trained as {size}, a multiple of vocab_multiple="
            f"{vocab_multiple}) is too large for this corpus: SentencePiece allows at most "
            f"{limit}; use vocab_size<={limit // vocab_multiple * vocab_multiple}.") from e
    return Tokenizer(model_prefix + ".model")


def bucket_batch_sizes(max_tokens: int, batch_multiple: int, max_length: int,
                       bucket_width: int) -> Dict[int, int]:
    """Maps each padded length L to its batch size B, the largest multiple of `batch_multiple`
    with `B * L <= max_tokens`.

    Example:
        >>> bucket_batch_sizes(256, 4, 32, 8)
        {8: 32, 16: 16, 24: 8, 32: 8}

    Raises:
        ValueError: non-positive arguments, `max_length % bucket_width != 0`, or
            `max_tokens < batch_multiple * max_length` (no valid batch for the longest bucket).
    """
    received = (f"Received max_tokens={max_tokens}, batch_multiple={batch_multiple}, "
                f"max_length={max_length}, bucket_width={bucket_width}")
    if min(max_tokens, batch_multiple, max_length, bucket_width) < 1:
        raise ValueError(f"{received}; all must be >= 1.")
    if max_length % bucket_width:
        raise ValueError(f"{received}; max_length must be a multiple of bucket_width, e.g. "
                         f"{_round_up(max_length, bucket_width)}.")
    if max_tokens < batch_multiple * max_length:
        raise ValueError(f"{received}; max_tokens must be >= batch_multiple * max_length = "
                         f"{batch_multiple * max_length} so the longest bucket gets a batch.")
    return {length: max_tokens // length // batch_multiple * batch_multiple
            for length in range(bucket_width, max_length + 1, bucket_width)}


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
    """Token ids (no bos/eos) of the pairs that fit `max_length`, and how many did not."""
    source: Tuple[List[int], ...]
    target: Tuple[List[int], ...]
    num_dropped: int


def encode_pairs(pairs: Sequence[Pair], tokenizer: Tokenizer, max_length: int) -> EncodedPairs:
    """Encodes pairs, dropping those with `len + 1 > max_length` on either side (eos or bos)."""
    sources = tokenizer.encode_batch([s for s, _ in pairs])
    targets = tokenizer.encode_batch([t for _, t in pairs])
    keep = [i for i, (s, t) in enumerate(zip(sources, targets))
            if max(len(s), len(t)) + 1 <= max_length]
    return EncodedPairs(tuple(sources[i] for i in keep), tuple(targets[i] for i in keep),
                        len(pairs) - len(keep))


def _padded(rows: Sequence[List[int]], length: int) -> np.ndarray:
    """`[len(rows), length]` int32, each row followed by zeros."""
    out = np.zeros([len(rows), length], dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def make_dataset(pairs: Sequence[Pair], tokenizer: Tokenizer, max_tokens: int,
                 batch_multiple: int = 1, max_length: int = 64, bucket_width: int = 8,
                 shuffle: bool = True, seed: int = 0, repeat: bool = False) -> tf.data.Dataset:
    """A length-bucketed, token-batched dataset of `((source_ids, decoder_input_ids), target_ids)`.

    All three are int32 `[B, L]`, padded with 0: `source_ids` = source + eos,
    `decoder_input_ids` = bos + target, `target_ids` = target + eos. A pair goes to the
    smallest L (a multiple of `bucket_width`) that holds both sides; every batch of
    that bucket has `B = bucket_batch_sizes(...)[L]` (remainders are dropped, so
    batches divide over replicas). Pairs longer than `max_length` are dropped; their
    count, the kept pairs and the batches per epoch are logged. Padding has target 0,
    so `SparseCategoricalCrossentropy(ignore_class=0)` masks it.

    Each epoch shuffles the pairs within each bucket and the order of the batches
    (a bucket too small for one batch is unused). Without `shuffle`, batches come
    bucket by bucket, shortest first. The padded ids are held in memory.

    Example:
        dataset = make_dataset(corpus.train, tokenizer, max_tokens=4096, batch_multiple=8,
                               repeat=True)
        model.fit(dataset, steps_per_epoch=100)

    Raises:
        ValueError: bad sizes (see `bucket_batch_sizes`), no pair fits `max_length`, or
            no bucket fills one batch.
    """
    sizes = bucket_batch_sizes(max_tokens, batch_multiple, max_length, bucket_width)
    encoded = encode_pairs(pairs, tokenizer, max_length)
    if not encoded.source:
        raise ValueError(f"None of the {len(pairs)} pairs fits max_length={max_length}.")
    lengths = np.array([max(len(s), len(t)) + 1 for s, t in zip(encoded.source, encoded.target)])
    buckets = -(-lengths // bucket_width) * bucket_width
    datasets, choices, used = [], [], 0
    for length, batch in sizes.items():
        index = np.flatnonzero(buckets == length)
        if len(index) < batch:
            continue
        # [n, L] each; a batch gathers B rows, so its shape [B, L] is static.
        source, decoder_input, target = (tf.constant(_padded(ids, length)) for ids in (
            [encoded.source[i] + [EOS_ID] for i in index],
            [[BOS_ID] + encoded.target[i] for i in index],
            [encoded.target[i] + [EOS_ID] for i in index]))
        rows = tf.data.Dataset.range(len(index))
        if shuffle:
            rows = rows.shuffle(len(index), seed=seed + length, reshuffle_each_iteration=True)
        rows = rows.repeat() if repeat else rows
        datasets.append(rows.batch(batch, drop_remainder=True).map(
            lambda i, s=source, d=decoder_input, t=target: (
                (tf.gather(s, i), tf.gather(d, i)), tf.gather(t, i))))
        choices += [len(datasets) - 1] * (len(index) // batch)
        used += len(index) // batch * batch
    logging.info("make_dataset: kept %d pairs, dropped %d longer than max_length=%d; "
                 "%d batches (%d pairs) per epoch.", len(lengths), encoded.num_dropped,
                 max_length, len(choices), used)
    if not choices:
        raise ValueError(f"make_dataset yields no full batch: {len(lengths)} pairs fit "
                         f"max_length={max_length}, each bucket fewer than its batch size in "
                         f"{sizes}; lower max_tokens or give more pairs.")
    order = tf.data.Dataset.from_tensor_slices(np.array(choices, dtype=np.int64))
    if shuffle:
        order = order.shuffle(len(choices), seed=seed, reshuffle_each_iteration=True)
    order = order.repeat() if repeat else order
    return tf.data.Dataset.choose_from_datasets(datasets, order).prefetch(tf.data.AUTOTUNE)


def make_eval_batches(sources: Sequence[str], tokenizer: Tokenizer, batch_size: int,
                      max_length: int, bucket_width: int = 8) -> Tuple[List[np.ndarray], int]:
    """In-order int32 `[batch_size, L]` batches of source ids + eos for translation.

    L is the batch's longest row rounded up to `bucket_width`; the last batch is
    filled with all-pad rows. Returns the batches and the number of real rows.

    Example:
        batches, n = make_eval_batches([s for s, _ in corpus.test], tokenizer, 64, 64)

    Raises:
        ValueError: a source longer than `max_length` (with eos); nothing is truncated.
    """
    if batch_size < 1:
        raise ValueError(f"Received batch_size={batch_size}; must be >= 1.")
    rows = [ids + [EOS_ID] for ids in tokenizer.encode_batch(sources)]
    for index, row in enumerate(rows):
        if len(row) > max_length:
            raise ValueError(f"Source {index} has {len(row)} tokens with eos, more than "
                             f"max_length={max_length}; raise max_length.")
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        length = _round_up(max(len(r) for r in chunk), bucket_width)
        batches.append(_padded(chunk + [[]] * (batch_size - len(chunk)), length))
    return batches, len(rows)
