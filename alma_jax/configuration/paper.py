"""The settings of the paper's image experiments, field by field, with their sources.

For each data set (MNIST, CIFAR-10), method (SM, Ens, UMix, gEns, gMoE, FF) and config field,
`SETTINGS` holds the paper's value (None where the paper is silent), the value of the authors'
released code (github.com/facebookresearch/alma; `NOT_RELEASED` where it has none) and where
each is stated. The value a run of the paper's setting uses (`Setting.value`, `expected`) is the
paper's, or the released code's where the paper is silent: the rule the defaults follow
(README, "Fidelity to the paper"). The `paper` variant (`IMAGE_VARIANTS` of
`alma_jax.configuration.plugins.tasks`) sets the fields whose defaults are not that value;
tests/configuration/test_paper_variant.py checks every image config file resolved with `:paper`
against this table, so the table and the variant are written apart and must agree.

Sources: the paper (the published version, /work/shared/paper/alma_paper.md) by section or
appendix and paragraph (that text carries no page numbers); the released code by file path
(and function) at its default branch. Fields the paper sweeps (`stream.wait`, `model.width`,
`stream.replay`) are a config's choice of one point of the sweep and are not listed; nor are
fields of speed only (strategies, slots, batch sizes of evaluation).

Imports nothing heavy (no JAX, not even the config schema): the docs and the tests read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DATASETS = ("mnist", "cifar10")
METHODS = ("sm", "ens", "umix", "gens", "gmoe", "ff")
NOT_RELEASED = "not released"  # the released code has no such setting (e.g. no MNIST Firefly)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One field's setting in the paper's experiments on `datasets` with `methods`.

  Attributes:
    path: the config field, e.g. "train.patience".
    paper: the paper's value; None where the paper is silent.
    released: the released code's value (`NOT_RELEASED`: none).
    source: where the paper states it, and where the released code sets it.
    datasets, methods: where the setting holds.
  """

  path: str
  paper: Any
  released: Any
  source: str
  datasets: tuple[str, ...] = DATASETS
  methods: tuple[str, ...] = METHODS

  @property
  def value(self) -> Any:
    """What a run of the paper's setting uses: the paper's value, else the released code's."""
    return self.released if self.paper is None else self.paper


_M, _C = ("mnist",), ("cifar10",)
_ENS = ("ens", "umix")
_NOT_ENS = ("sm", "gens", "gmoe", "ff")
_YAML_25 = ("configs/{mnist,cifar10}/test_finetune_{mlp,vgg}.yaml (SM), configs/mnist/"
            "ensemble.yaml and configs/cifar10/test_ensemble_vgg.yaml (gEns), configs/*/"
            "test_usage_gmoe.yaml (gMoE), configs/cifar10/test_firefly.yaml (FF; no MNIST "
            "Firefly config)")
_YAML_100 = ("configs/{mnist,cifar10}/kensemble*.yaml (Ens: KEnsemble), configs/{mnist,cifar10}/"
             "agg_ensemble*.yaml (UMix: AggEnsemble)")

SETTINGS = (
    # -- the stream and the protocol
    Setting("stream.num_megabatches", 500, NOT_RELEASED,
            "paper section 5, Datasets: 'B = 500 for MNIST'; released: n_megabatches is the "
            "number of training stages (commands.txt), not the paper's B", datasets=_M),
    Setting("stream.num_megabatches", 100, NOT_RELEASED,
            "paper section 5, Datasets: 'B = 100 for CIFAR'; released: n_megabatches is the "
            "number of training stages (commands.txt: 1, 10, 50)", datasets=_C),
    Setting("stream.val_fraction", 0.1, 0.1,
            "paper section 5, Datasets (step 2) and App. B.1: 10% of each mega-batch; released: "
            "validation_proportion: 0.1 in every configs/*/*.yaml"),
    Setting("stream.warm_start", "finetune", "finetune",
            "paper section 4.1, SM: 'initialized from the parameters of the model trained on the "
            "previous mega-batch'; released: init_from_scratch: False or absent "
            "(configs/*/*.yaml)"),
    # -- the model
    Setting("model.name", "mlp", "mlp",
            "paper section 5, Models, and App. B.1.1: an MLP with 2 hidden layers; released: "
            "crlapi/sl/architectures/mlp.py (configs/mnist/*.yaml)", datasets=_M),
    Setting("model.name", "vgg", "vgg",
            "paper section 5, Models, and App. B.1.2: the reduced VGG19 with BatchNorm of Wu et "
            "al. (2020); released: crlapi/sl/architectures/vgg.py (configs/cifar10/*.yaml)",
            datasets=_C),
    Setting("model.init", None, "torch",
            "paper: not stated; released: PyTorch's default initialisation (crlapi/sl/"
            "architectures/mlp.py, vgg.py build nn.Linear/nn.Conv2d and never re-initialise "
            "them)"),
    # -- training
    Setting("train.batch_size", 128, 128,
            "paper App. B.1: 'A training minibatch size of 128'; released: training_batch_size: "
            "128 (configs/*/*.yaml)"),
    Setting("train.epochs", 100, 100,
            "paper App. B.1.1 and B.1.2: 'trained for 100 epochs'; released: max_epochs: 100 "
            "(configs/*/*.yaml)"),
    Setting("train.patience", None, 25,
            "paper: not stated; released: patience: 25 in " + _YAML_25, methods=_NOT_ENS),
    Setting("train.patience", None, 100,
            "paper: not stated; released: patience: 100 in " + _YAML_100, methods=_ENS),
    Setting("train.patience_delta", None, 0.001,
            "paper: not stated; released: patience_delta: 0.001 in " + _YAML_25 + ", read by "
            "crlapi/sl/clmodels/finetune.py, finetune_grow.py, ensemble.py, firefly.py (update)",
            methods=_NOT_ENS),
    Setting("train.patience_delta", None, 0.0,
            "paper: not stated; released: ignored, an epoch improves on any gain (crlapi/sl/"
            "clmodels/k_ensemble.py KEnsemble.update and agg_ensemble.py AggEnsemble.update "
            "compare with the best accuracy without patience_delta)", methods=_ENS),
    Setting("train.keep_optimizer_state", None, False,
            "paper: not stated; released: a fresh optimizer at every stage (self.get_optimizer "
            "in each crlapi/sl/clmodels/*.py update)"),
    Setting("train.augment", "none", "none",
            "paper App. B.1.1: no augmentation stated for MNIST; released: kornia_augs empty "
            "(configs/mnist/*.yaml)", datasets=_M),
    Setting("train.augment", "crop_flip", "crop_flip",
            "paper App. B.1.2: random horizontal flips, random crops with 4-pixel padding; "
            "released: kornia RandomCrop(32, padding=4) + RandomHorizontalFlip "
            "(configs/cifar10/*.yaml)", datasets=_C),
    # -- the optimizer
    Setting("optimizer.name", "adadelta", "adadelta",
            "paper App. B.1.1: AdaDelta; released: torch.optim.Adadelta (configs/mnist/*.yaml)",
            datasets=_M),
    Setting("optimizer.kwargs.learning_rate", 1.0, 1.0,
            "paper App. B.1.1: 'default learning rate of 1'; released: lr: 1. "
            "(configs/mnist/*.yaml)", datasets=_M),
    Setting("optimizer.weight_decay", 0.0, 0.0,
            "paper App. B.1.1: no weight decay stated for MNIST; released: Adadelta without "
            "weight_decay (configs/mnist/*.yaml)", datasets=_M),
    Setting("optimizer.name", "sgd", "sgd",
            "paper App. B.1.2: Stochastic Gradient Descent; released: torch.optim.SGD "
            "(configs/cifar10/*.yaml)", datasets=_C),
    Setting("optimizer.kwargs.learning_rate", 0.01, 0.01,
            "paper App. B.1.2: 'a learning rate of 0.01'; released: lr: 0.01 "
            "(configs/cifar10/*.yaml)", datasets=_C),
    Setting("optimizer.kwargs.momentum", 0.9, 0.9,
            "paper App. B.1.2: 'momentum value of 0.9'; released: momentum: 0.9 "
            "(configs/cifar10/*.yaml)", datasets=_C),
    Setting("optimizer.weight_decay", 1e-4, 1e-4,
            "paper App. B.1.2: 'weight decay of 1e-4'; released: weight_decay: 1e-4 "
            "(configs/cifar10/*.yaml)", datasets=_C),
    Setting("optimizer.kwargs.nesterov", None, True,
            "paper App. B.1.2: momentum, Nesterov not stated; released: nesterov: True in "
            "configs/cifar10/test_usage_gmoe.yaml (gMoE) and test_firefly.yaml (FF)",
            datasets=_C, methods=("gmoe", "ff")),
    Setting("optimizer.kwargs.nesterov", None, False,
            "paper App. B.1.2: momentum, Nesterov not stated; released: no nesterov (PyTorch: "
            "False) in configs/cifar10/test_finetune_vgg.yaml (SM), kensemble_vgg.yaml (Ens), "
            "agg_ensemble_vgg.yaml (UMix), test_ensemble_vgg.yaml (gEns)",
            datasets=_C, methods=("sm", "ens", "umix", "gens")),
    # -- Ens and UMix
    Setting("method.num_members", 5, 3,
            "paper App. B.1: 'UMix and Ens models have N = 5 in all experiments'; released: k: 3 "
            "(configs/*/kensemble*.yaml, agg_ensemble*.yaml)", methods=_ENS),
    Setting("method.combine", "mean", "sum",
            "paper section 4.1, UMix: 'the average (in logit space)'; released: the sum of the "
            "members' logits (crlapi/sl/clmodels/agg_ensemble.py AggEnsemble.update)",
            methods=("umix",)),
    # -- gEns
    Setting("method.initial_members", 1, 1,
            "paper section 4.2, gEns: 'when starting with a single component'; released: "
            "Ensemble.update builds one model at the first stage (crlapi/sl/clmodels/ensemble.py)",
            methods=("gens",)),
    Setting("method.grow_by", 1, 1,
            "paper section 4.2, gEns: 'we use k = 1', and App. B.1: 'we train one model n = 1 at "
            "every mega-batch'; released: one model per stage (crlapi/sl/clmodels/ensemble.py "
            "Ensemble.update)", methods=("gens",)),
    Setting("method.new_member", None, "copy",
            "paper section 4.2: 'k new neural networks are added', not how; released: "
            "copy.deepcopy(self.models[t-1]) (crlapi/sl/clmodels/ensemble.py Ensemble.update)",
            methods=("gens",)),
    Setting("method.combine", "probs", "logits",
            "paper section 4.1, Ens: 'the average probability distribution', and section 4.2: "
            "gEns is 'like the Ens model' a combination of networks; released: the mean of the "
            "members' logits (crlapi/sl/clmodels/ensemble.py Ensemble.forward)",
            methods=("gens",)),
    # -- gMoE
    Setting("method.gating", "soft", "soft",
            "paper App. B.1.1: 'we report results with soft gating'; released: is_hard: False "
            "(configs/mnist/test_usage_gmoe.yaml)", datasets=_M, methods=("gmoe",)),
    Setting("method.gating", None, "soft",
            "paper: soft or hard (App. A), CIFAR-10's not stated; released: is_hard: False "
            "(configs/cifar10/test_usage_gmoe.yaml)", datasets=_C, methods=("gmoe",)),
    Setting("method.tree", True, True,
            "paper section 4.2 and App. A (eq. 3, Fig. 6): a binary gating tree; released: the "
            "split expert becomes a MixtureLayer with a gate of its own (crlapi/sl/architectures/"
            "mixture_model.py MoE_UsageGrow._generate_splitting)", methods=("gmoe",)),
    Setting("method.grow", True, True,
            "paper section 4.2: experts are added over time; released: Finetune_Grow "
            "(configs/*/test_usage_gmoe.yaml)", methods=("gmoe",)),
    Setting("method.initial_experts", 1, 2,
            "paper section 5, Models: 'gMoE also starts off as SM', App. A: 'if we start from a "
            "single expert'; released: n_experts: 2 (configs/*/test_usage_gmoe.yaml)",
            methods=("gmoe",)),
    Setting("method.grow_every", 1, 1,
            "paper App. A: 'A growth step is triggered at each stage'; released: grow_every: 1 "
            "(configs/*/test_usage_gmoe.yaml; configs/cifar10/commands.txt runs 2 and 5)",
            methods=("gmoe",)),
    Setting("method.split_by", "loss", "usage",
            "paper section 4.2 and App. A: the expert with the largest cumulative validation "
            "loss; released: the largest summed gate weight (crlapi/sl/architectures/"
            "mixture_model.py MoE_UsageGrow.grow)", methods=("gmoe",)),
    Setting("method.gate_pool", None, 4,
            "paper: not stated; released: n_adaptivepooling: 4 "
            "(configs/cifar10/test_usage_gmoe.yaml)", datasets=_C, methods=("gmoe",)),
    # -- Firefly: App. B.1.2 keeps the Firefly authors' defaults but the growth rate
    Setting("method.growth_rate", 0.25, 0.6,
            "paper App. B.1: 'a growth rate of 0.25', B.1.2: linear growth; released: "
            "grow_ratio: 0.6 (configs/cifar10/test_firefly.yaml)", methods=("ff",)),
    Setting("method.grow_every", None, 1,
            "paper: not stated; released: grow_every: 1 (configs/cifar10/test_firefly.yaml; "
            "commands.txt runs 2 and 5)", methods=("ff",)),
    Setting("method.num_new", None, 70,
            "paper App. B.1.2: the Firefly codebase's defaults; released: SpModule.K = 70 "
            "(crlapi/sl/architectures/firefly_vgg/sp/module.py)", methods=("ff",)),
    Setting("method.epsilon", None, 1.0,
            "paper App. B.1.2: the Firefly codebase's defaults; released: splits w +- v and new "
            "neurons' fitted weights, unscaled (crlapi/sl/architectures/firefly_vgg/sp/conv.py "
            "SpConv2d.spffn_active_grow, spffn_passive_grow)", methods=("ff",)),
    Setting("method.split_init", None, 0.1,
            "paper App. B.1.2: the Firefly codebase's defaults; released: v.uniform_(-1e-1, 1e-1) "
            "(firefly_vgg/sp/conv.py SpConv2d.spffn_reset)", methods=("ff",)),
    Setting("method.new_in_init", None, 0.1,
            "paper App. B.1.2: the Firefly codebase's defaults; released: vno.normal_(0, 0.1) "
            "(firefly_vgg/sp/conv.py SpConv2d.spffn_reset)", methods=("ff",)),
    Setting("method.new_out_init", None, 0.01,
            "paper App. B.1.2: the Firefly codebase's defaults; released: vni.uniform_(-1e-2, "
            "1e-2) (firefly_vgg/sp/conv.py SpConv2d.spffn_reset)", methods=("ff",)),
    Setting("method.split_penalty", None, 1e-2,
            "paper App. B.1.2: the Firefly codebase's defaults; released: 1e-2 |v|^2 "
            "(firefly_vgg/sp/conv.py SpConv2d.spffn_penalty)", methods=("ff",)),
    Setting("method.new_penalty", None, 1e-4,
            "paper App. B.1.2: the Firefly codebase's defaults; released: 1e-2 * 1e-2 |vno|^2 "
            "(firefly_vgg/sp/conv.py SpConv2d.spffn_penalty)", methods=("ff",)),
    Setting("method.fit_lr", None, 1e-3,
            "paper App. B.1.2: the Firefly codebase's defaults; released: RMSprop lr=1e-3 "
            "(crlapi/sl/clmodels/firefly.py Firefly.spffn)", methods=("ff",)),
    Setting("method.fit_examples", None, 0,
            "paper App. B.1.2: the Firefly codebase's defaults; released: the whole stage's "
            "training data, n_batches=-1 (crlapi/sl/clmodels/firefly.py Firefly.split)",
            methods=("ff",)),
)


def settings(dataset: str, method: str) -> dict[str, Setting]:
  """The settings of `method` on `dataset`, by field path."""
  out = {}
  for s in SETTINGS:
    if dataset in s.datasets and method in s.methods:
      if s.path in out:
        raise ValueError(f"{s.path} is listed twice for {dataset}/{method}")
      out[s.path] = s
  return out


def expected(dataset: str, method: str) -> dict[str, Any]:
  """Field path -> the value of the paper's setting of `method` on `dataset`."""
  return {p: s.value for p, s in settings(dataset, method).items()}
