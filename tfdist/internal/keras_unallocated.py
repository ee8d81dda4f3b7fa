"""Keras models built without allocating their weights (for planning).

`keras.StatelessScope` defers a new variable's value, but on leaving the
outermost scope Keras initializes every variable still waiting
(`initialize_all_variables`), and `initialize_variables=False` only moves
that to the next outermost scope anyone leaves (the TF backend's
`compute_output_spec` opens one for every layer call on symbolic inputs): a
planned 1 GiB model would be allocated at the next model built after it.

Private Keras API used here (and only here): `global_state`'s entries
"stateless_scope" (the open scope) and "uninitialized_variables", which `Variable.__init__` appends to inside a
stateless scope and `initialize_all_variables` empties. `unallocated()` takes
the variables created inside it off that list, so they never get a value.
Checked by `tests/internal/test_keras_unallocated.py`.
"""

import contextlib

import keras
from keras.src.backend.common import global_state

_LIST = "uninitialized_variables"


@contextlib.contextmanager
def unallocated():
    """Variables created inside get a shape, dtype and path but never a value.

    Build a model inside to read what it would store (`tfdist.planner`'s
    inventories); the model cannot run. Outside any other stateless scope only.
    """
    if global_state.get_global_attribute("stateless_scope") is not None:
        raise RuntimeError("tfdist: unallocated() inside a keras.StatelessScope: the "
                           "variables would be initialized when that scope ends.")
    waiting = list(global_state.get_global_attribute(_LIST) or ())
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        kept = {id(v) for v in waiting}
        now = global_state.get_global_attribute(_LIST) or ()
        global_state.set_global_attribute(_LIST, [v for v in now if id(v) in kept])
