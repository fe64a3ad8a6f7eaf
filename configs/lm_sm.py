"""SM for language modelling: one Switch Transformer (E=4 experts per block) on a text stream.

GPT-2 BPE tokens of tiny_shakespeare (tfds) in B=4 mega-batches of sequences
of L tokens; a fixed number of Adam steps per mega-batch, the learning rate
warmed up and decayed to 0 within every stage (paper section 5, App. B.2).
The BPE files are read from config.data.bpe_dir or $ALMA_JAX_BPE_DIR.

Run:
  export ALMA_JAX_BPE_DIR=/path/to/gpt2_bpe     # encoder.json, vocab.bpe
  python -m alma_jax.main --config=configs/lm_sm.py:quick --workdir=/tmp/lm_sm
Variants (after the colon, comma-separated):
  :smoke  seconds: the tiny model, L=32, 80 sequences, 5 steps per stage (tests).
  :quick  minutes on a 2-core CPU: the tiny model on the whole stream, L=64,
          80 steps of 8 sequences per stage.
  :base, :large  the paper's model sizes (6 layers, d=512; 12 layers, d=768);
          the default is base, with L=512, batch 192, 120,000 steps per stage.
  :quick,iid  Table 1's i.i.d. counterpart: one stage at t=B on the union of
          the B mega-batches with B times the steps.
Options:
  --config.model.num_experts=8            E (paper: 4, 8, 12)
  --config.data.text_file=/path/book.txt  a UTF-8 text file instead of tfds
  --config.train.steps_per_epoch=240      3x steps (the quick stage has 80)
  --config.stream.wait=4                  train once on all mega-batches
"""

from alma_jax.configuration import config_lib


def get_config(arg=None):
  c = config_lib.base_config("tiny_shakespeare", "lm_sm")
  return config_lib.apply_variant(c, arg)
