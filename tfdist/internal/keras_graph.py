"""A functional Keras model's graph, read to cut it into pipeline stages.

Private Keras detail used here (and only here): a symbolic `KerasTensor`'s
`_keras_history` (the operation and call that made it) and an operation's
`_inbound_nodes[i].arguments` (the call's arguments, `SymbolicArguments`,
with `keras_tensors` and `fill_in`). Keras builds `Functional` models from the
same records; `tests/internal/test_keras_graph.py` checks both.

- `inline`: a functional model whose nested functional models (a keras-hub
  `CausalLM` around its backbone) are inlined, so that a cut can fall between
  two of the backbone's decoder blocks;
- `crossings`: for cuts at given tensors, the tensors each boundary must carry
  (the cut tensor, and every earlier tensor used after it: a padding mask that
  every block reads travels along).
"""

from typing import Dict, List, Sequence

import keras


def _history(tensor):
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        raise ValueError(f"{tensor!r} is not a symbolic tensor of a functional Keras model.")
    return history


def _node(tensor):
    operation, node_index, _ = _history(tensor)
    return operation._inbound_nodes[node_index]


def producers(tensor) -> List:
    """The symbolic tensors the call that made `tensor` read (none for an Input)."""
    return list(_node(tensor).arguments.keras_tensors)


def inline(model) -> keras.Model:
    """`model` with every nested functional model's layers called in its place.

    Returns `model` itself when it nests none. The layers are the model's own
    (no copy, same weights); only the calls that read a nested model's outputs
    are made again, on the inlined tensors.
    """
    replayed: Dict[int, List] = {}  # id(node) -> its outputs in the inlined graph

    def resolve(tensor, memo):
        if id(tensor) in memo:
            return memo[id(tensor)]
        operation, _, index = _history(tensor)
        node = _node(tensor)
        args = node.arguments.keras_tensors
        if not args:  # an Input of the outermost model
            result = tensor
        elif isinstance(operation, keras.Model) and hasattr(operation, "_inbound_nodes") \
                and _is_functional(operation):
            inner = dict(memo)
            for own, given in zip(keras.tree.flatten(operation.input), args):
                inner[id(own)] = resolve(given, memo)
            result = resolve(keras.tree.flatten(operation.output)[index], inner)
        else:
            values = {id(a): resolve(a, memo) for a in args}
            if all(values[id(a)] is a for a in args):
                result = tensor
            else:
                if id(node) not in replayed:
                    call_args, call_kwargs = node.arguments.fill_in(values)
                    replayed[id(node)] = keras.tree.flatten(operation(*call_args, **call_kwargs))
                result = replayed[id(node)][index]
        memo[id(tensor)] = result
        return result

    if not any(_is_functional(layer) for layer in model.layers):
        return model
    memo = {id(t): t for t in keras.tree.flatten(model.input)}
    outputs = keras.tree.map_structure(lambda t: resolve(t, memo), model.output)
    return keras.Model(model.input, outputs, name=model.name)


def _is_functional(layer) -> bool:
    return isinstance(layer, keras.Model) and hasattr(layer, "_nodes_by_depth")


def crossings(inputs: Sequence, cuts: Sequence, outputs: Sequence) -> List[List]:
    """What crosses each cut of a functional graph into the stages after it.

    Args:
        inputs: the model's input tensors (flat).
        cuts: the tensors after which the graph is cut (p - 1 of them, in order).
        outputs: the model's output tensors (flat).

    Returns:
        p + 1 lists of tensors: `inputs`, then for each cut k the tensors stage
        k + 1 reads from before it (the cut tensor first if it is read, then the
        others in the order a walk back from the outputs meets them), then `outputs`.
        Stage k computes list k + 1 from list k.
    """
    inputs_ids = {id(t) for t in inputs}

    def ancestry(tensor):
        seen, stack = {}, [tensor]
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen[id(t)] = t
            if id(t) not in inputs_ids:
                stack.extend(producers(t))
        return seen

    lists = [list(outputs)]
    for cut in reversed(list(cuts)):
        before = ancestry(cut)
        found, seen, stack = [], set(), list(reversed(lists[0]))
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in before or id(t) in inputs_ids:
                found.append(t)
            else:
                stack.extend(reversed(producers(t)))
        found.sort(key=lambda t: t is not cut)  # the cut tensor first; stable otherwise
        lists.insert(0, found)
    return [list(inputs)] + lists
