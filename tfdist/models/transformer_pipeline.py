"""tfdist's NMT `Transformer` cut into pipeline stages (`layers:stage`).

The layer stack is the encoder's blocks then the decoder's, E + D of them;
a `PipelinePlan` splits it over the stage axis (E + D must divide by the
stages). Stage k runs its blocks with the same `EncoderBlock` /
`DecoderBlock` layers as `Transformer`:

- the first stage embeds the source;
- the stage with the last encoder block applies the encoder's final norm
  (its output is the *memory*) and embeds the decoder's input;
- the last stage applies the decoder's final norm and the output projection,
  tied to the target embedding (Press & Wolf): that table lives on the stage
  that first uses it and the others read it, and it gets the sum of their
  gradients once per step (`Pipeline.train_step`). With `share_embeddings`
  the source embedding is the same table.

Between stages travels a dict of tensors: the source ids (each stage derives
the padding mask from them), the encoder's states or the memory, and the
decoder's input ids or states. Every stage has its own embedding dropout (one
layer per stage keeps each stage's random state on its own device).

Outputs are the full logits `[b, Lt, V]` (one device per stage: no vocabulary
split), trained with `SequenceCrossentropy`; `transformer_weights` maps
weights to a `Transformer`'s by path, to load or compare.
"""

import dataclasses
import weakref

import keras
import tensorflow as tf

from tfdist.layers import ShardedEmbedding
from tfdist.models.transformer import PAD_ID
from tfdist.models.transformer_layers import DecoderBlock, EncoderBlock, sinusoids
from tfdist.pipeline.model import Pipeline


class TransformerStage(keras.layers.Layer):
    """Blocks `first`..`last - 1` of the encoder + decoder stack, with the
    embeddings, norms and projection that fall on this stage.

    Args:
        config: the `TransformerConfig`.
        blocks: the stack indices this stage runs (a range).
        shared: the layers stages share, made once by `transformer_stages`:
            `source_embedding`, `target_embedding` (the same object when the
            config shares them) and `positions` (the learned table's layer, or None).
        stage, num_stages: this stage's index and their count.
    """

    def __init__(self, config, blocks, shared, stage, num_stages, **kwargs):
        super().__init__(**kwargs)
        c = self.model_config = config
        self.blocks_range = blocks
        self.stage, self.num_stages = stage, num_stages
        E = c.num_encoder_layers
        self.embeds_source = stage == 0
        self.ends_encoder = E - 1 in blocks
        self.projects = stage == num_stages - 1
        self.source_embedding = shared["source_embedding"] if self.embeds_source else None
        self.target_embedding = (shared["target_embedding"]
                                 if self.ends_encoder or self.projects else None)
        self.positions = shared["positions"] if self.embeds_source or self.ends_encoder else None
        self.blocks = [EncoderBlock(c, j, name=f"encoder_{j}") if j < E else
                       DecoderBlock(c, j - E, name=f"decoder_{j - E}") for j in blocks]
        self.encoder_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, name="encoder_norm") if self.ends_encoder else None
        self.decoder_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, name="decoder_norm") if self.projects else None
        self.drop = keras.layers.Dropout(c.dropout)
        self.table = tf.constant(sinusoids(c.max_length, c.d_model))

    def get_config(self):
        """This stage's place in the stack; the layers it shares with other stages
        (the tied embeddings) are rebuilt by `TransformerPipeline.from_config`."""
        return {**super().get_config(), "config": dataclasses.asdict(self.model_config),
                "blocks": [self.blocks_range.start, self.blocks_range.stop],
                "stage": self.stage, "num_stages": self.num_stages}

    @classmethod
    def from_config(cls, config):
        raise ValueError("A TransformerStage shares its embeddings with the other stages: "
                         "rebuild the whole pipeline (TransformerPipeline.from_config, or "
                         "transformer_stages(config, plan)), not one stage.")

    def build(self, input_shape=None):
        shape = (None, None, self.model_config.d_model)
        for layer in (self.source_embedding, self.target_embedding, self.positions):
            if layer is not None and not layer.built:
                layer.build()
        for layer in [*self.blocks, self.encoder_norm, self.decoder_norm]:
            if layer is not None:
                layer.build(shape)
        self.built = True

    def _embed(self, embedding, ids, training):
        c = self.model_config
        x = embedding(ids) * (c.d_model ** 0.5)
        table = self.positions.table if self.positions is not None and c.positions == "learned" \
            else self.table
        x = x + tf.cast(table, x.dtype)[:tf.shape(ids)[1]][None]
        return self.drop(x, training=training)

    def call(self, state, training=None):
        if not isinstance(state, dict):  # the first stage: Transformer's inputs
            state = {"source_ids": state[0], "target_ids": state[1]}
        state = dict(state)
        E = self.model_config.num_encoder_layers
        mask = tf.cast(tf.not_equal(state["source_ids"], PAD_ID), self.compute_dtype)
        if self.embeds_source:
            state["x"] = self._embed(self.source_embedding, state["source_ids"], training)
        for j, block in zip(self.blocks_range, self.blocks):
            if j < E:
                state["x"] = block(state["x"], source_mask=mask, training=training)
                if j == E - 1:
                    state["memory"] = self.encoder_norm(state["x"])
                    state["x"] = self._embed(self.target_embedding, state.pop("target_ids"),
                                             training)
            else:
                state["x"] = block(state["x"], state["memory"], memory_mask=mask,
                                   training=training)
        if self.projects:
            states = self.decoder_norm(state["x"])
            return tf.einsum("bld,vd->blv", states, self.target_embedding.embeddings)
        return state


class _Positions(keras.layers.Layer):
    """The learned position table, one weight named like `Transformer`'s."""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config_ = config

    def build(self, input_shape=None):
        c = self.config_
        self.table = self.add_weight(name="positions", shape=(c.max_length, c.d_model),
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))
        self.built = True


def transformer_stages(config, plan):
    """The `TransformerStage`s of `config` laid out by `plan` (a `PipelinePlan`
    over `num_encoder_layers + num_decoder_layers` layers), unbuilt."""
    c = config.validate()
    total = c.num_encoder_layers + c.num_decoder_layers
    if plan.num_layers != total:
        raise ValueError(f"The plan splits {plan.num_layers} layers but the Transformer has "
                         f"{c.num_encoder_layers} encoder + {c.num_decoder_layers} decoder "
                         f"blocks = {total}.")
    init = keras.initializers.RandomNormal(stddev=c.d_model ** -0.5)
    target = ShardedEmbedding(c.vocab_size, c.d_model, embeddings_initializer=init,
                              name="target_embedding")
    source = target if c.share_embeddings else ShardedEmbedding(
        c.vocab_size, c.d_model, embeddings_initializer=init, name="source_embedding")
    shared = {"source_embedding": source, "target_embedding": target,
              "positions": _Positions(c, name="positions") if c.positions == "learned" else None}
    count = plan.num_stages * plan.num_chunks
    return [TransformerStage(c, plan.layers_of(k), shared, k, count, name=f"stage_{k}")
            for k in range(count)]


def transformer_weights(stages):
    """`{path: variable}` of the stages' weights under `Transformer`'s paths
    (`encoder_0/...`, `target_embedding/embeddings`, ...), each once."""
    found = {}
    for stage in stages:
        for v in stage.weights:
            parts = v.path.split("/")
            path = "/".join(parts[1:]) if parts[0].startswith("stage_") else v.path
            if path.startswith("positions/"):
                path = "positions"
            found.setdefault(path, v)
    return found


def pipelined_transformer(config, plan, devices, max_source_length=None, max_target_length=None):
    """A `TransformerPipeline` of `config`'s Transformer laid out by `plan` over
    `devices` (the mesh's devices, device i at index i).

    Inputs: `(source_ids [b, Ls], decoder_input_ids [b, Lt])`, as `Transformer`.
    """
    if len(devices) != plan.mesh.size:
        raise ValueError(f"Mesh {plan.mesh.shape} has {plan.mesh.size} devices but "
                         f"{len(devices)} were given: {list(devices)}.")
    grid = [tuple(devices[i] for i in plan.stage_devices(s)) for s in range(plan.num_stages)]
    ls = max_source_length or config.max_length
    lt = max_target_length or config.max_length
    return TransformerPipeline(config, transformer_stages(config, plan), devices=grid,
                               schedule=plan.schedule_name,
                               num_microbatches=plan.num_microbatches,
                               num_chunks=plan.num_chunks, input_shape=((ls,), (lt,)),
                               input_dtype=("int32", "int32"))


class TransformerPipeline(Pipeline):
    """A pipelined Transformer with `translate` like `Transformer`'s: decoding
    runs on a one-device `Transformer` holding the pipeline's current weights
    (`one_device_copy`, refreshed on each call)."""

    def __init__(self, config, stages, **kwargs):
        super().__init__(stages, **kwargs)
        self.model_config = config

    def translate(self, *args, **kwargs):
        return one_device_copy(self).translate(*args, **kwargs)

    def get_config(self):
        config = super().get_config()
        del config["stages"]  # rebuilt from the Transformer's config (tied embeddings)
        return {**config, "config": dataclasses.asdict(self.model_config),
                "num_stages": len(self.stages) // self.num_chunks}

    @classmethod
    def from_config(cls, config):
        from tfdist.models.transformer_layers import TransformerConfig
        from tfdist.pipeline.layout import PipelinePlan

        config = dict(config)
        model = TransformerConfig(**config.pop("config"))
        p = config.pop("num_stages")
        plan = PipelinePlan.from_mesh(
            f"stage:{p}", "layers:stage", model.num_encoder_layers + model.num_decoder_layers,
            config["num_microbatches"], config["schedule"], config["num_chunks"])
        return cls(model, transformer_stages(model, plan), **config)


_COPIES = weakref.WeakKeyDictionary()  # pipeline -> its one-device Transformer


def one_device_copy(pipeline, device="/cpu:0"):
    """A `Transformer` on one device holding `pipeline`'s weights (made once
    per pipeline, its weights refreshed on every call)."""
    from tfdist.models.transformer import Transformer

    copy = _COPIES.get(pipeline)
    if copy is None:
        with tf.device(device):
            copy = _COPIES[pipeline] = Transformer(pipeline.model_config, name="transformer")
    weights = transformer_weights(pipeline.stages)
    for v in copy.weights:
        v.assign(weights["/".join(v.path.split("/")[1:])])
    return copy
