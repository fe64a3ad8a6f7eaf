"""The grid behind REPRODUCTION.md: the paper's findings F1-F7 on reduced protocols.

  python launch/sweep.py --root=/tmp/findings --grid_file=launch/grids/findings.py --parallel=2

MNIST `:quick` (the whole stream, B=500 mega-batches, w=10 unless a grid says
otherwise, at most 20 epochs per stage, patience 5) and tiny_shakespeare
`lm_*.py:quick`; three seeds per point (one `num_seeds=3` run each).
"""

_SEEDS = [0, 1, 2]
_SM = ["configs/mnist_sm.py:quick"]

GRID = [
    # F2 (bigger models), F3 (Ens vs UMix), the fixed models of F4.
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 16, 64, 256], "seed": _SEEDS},
    {"config": _SM, "method.name": ["ens", "umix"], "model.width": [4, 64], "seed": _SEEDS},
    # F1: waiting time, small and larger models, no replay (w=10 is above).
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 64], "stream.wait": [1, 50, 250],
     "seed": _SEEDS},
    # F5: replay of every earlier mega-batch, against the same models at w=50 above.
    {"config": _SM, "method.name": ["sm"], "model.width": [4, 64], "stream.wait": [50],
     "stream.replay": [1.0], "seed": _SEEDS},
    # F4: growing methods against the fixed models; F7: tree-gated vs flat gMoE.
    {"config": ["configs/mnist_gens.py:quick", "configs/mnist_ff.py:quick"], "seed": _SEEDS},
    {"config": ["configs/mnist_gmoe.py:quick"], "method.tree": [True, False], "seed": _SEEDS},
    # F6: language models, sequential vs i.i.d. stream at equal compute.
    {"config": ["configs/lm_sm.py:quick"], "stream.iid": [False, True], "seed": _SEEDS},
]
