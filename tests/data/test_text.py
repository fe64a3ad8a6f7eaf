"""Tests of the text data (alma_jax/data/text.py), the text task (alma_jax/tasks/text.py), the
language-model configs and whole runs of them."""

import json
import math
import os
import re
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.configuration import config_lib
from alma_jax.data import text as text_data
from alma_jax.engine import optim
from alma_jax.engine import population
from alma_jax.engine.metrics import Log, Record
from alma_jax.errors import ConfigError, DivergenceError
from alma_jax.outputs import io_utils
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from alma_jax.tasks import text as text_task
from tests.conftest import BPE_DIR, requires_bpe, requires_shakespeare

BPE = BPE_DIR

SAMPLE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n  Tabs\tand  "
          "spaces, naïve café — ünïcödé 日本語 🙂 <|endoftext|> 12345 don't it's\r\n")


@requires_bpe
def test_tokenizer_loads_from_local_files_and_round_trips_text_exactly():
  enc = text_data.load_tokenizer(text_data.bpe_dir(BPE))
  assert enc.n_vocab == text_data.VOCAB_SIZE == 50257
  assert text_data.encode(enc, "Hello world").tolist() == [15496, 995]  # GPT-2's ids
  tokens = text_data.encode(enc, SAMPLE)
  assert tokens.dtype == np.uint16
  assert enc.decode(tokens.tolist()) == SAMPLE
  assert int(text_data.token_bytes(enc)[tokens].sum()) == len(SAMPLE.encode("utf-8"))


def test_missing_bpe_files_name_the_field(tmp_path):
  with pytest.raises(text_data.TokenizerUnavailableError, match=r"config\.data\.bpe_dir=.*lacks"):
    text_data.bpe_dir(str(tmp_path))


def test_split_text_cuts_after_a_line_break():
  # The cut (at 70% of 20 characters: 14) moves back to just after the last line break.
  train, test = text_data.split_text("aaaa\nbbbb\ncccc\ndddd\n", 0.3)
  assert (train, test) == ("aaaa\nbbbb\n", "cccc\ndddd\n")
  with pytest.raises(ValueError, match="test_fraction"):
    text_data.split_text("abc", 1.0)


def test_sequences_overlap_by_one_token_and_targets_are_the_next_tokens():
  task = text_task.TextTask(seq_len=4)
  tokens = np.arange(100, 121, dtype=np.int32)  # 21 training tokens: 5 sequences
  data = text_task.TextData(tokens=jnp.asarray(tokens), starts=jnp.arange(5) * 4, num_train=5,
                            seq_len=4)
  x, y = task.inputs(data, jnp.asarray([[0, 2]]))
  np.testing.assert_array_equal(x[0], [[100, 101, 102, 103], [108, 109, 110, 111]])
  np.testing.assert_array_equal(y[0], [[101, 102, 103, 104], [109, 110, 111, 112]])
  assert text_data.num_sequences(21, 4) == 5 and text_data.num_sequences(20, 4) == 4


def test_per_example_gives_token_error_rate_and_mean_nll():
  logp = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
  errors, nll = text_task.TextTask(seq_len=2).per_example(logp, jnp.asarray([[0, 2]]))
  np.testing.assert_allclose(errors, [0.5])
  np.testing.assert_allclose(nll, [(-math.log(0.5) - math.log(0.1)) / 2], rtol=1e-6)


def test_bits_per_byte_is_the_total_nll_in_bits_over_the_bytes():
  task = text_task.TextTask(seq_len=8)
  task.test_target_tokens, task.test_target_bytes = 100, 400
  out = task.record_metrics(2.0, {"train_macs_per_example": 80.0, "inference_per_example": 16.0})
  assert out["test_perplexity"] == pytest.approx(math.exp(2.0))
  assert out["test_bits_per_byte"] == pytest.approx(2.0 * 100 / math.log(2) / 400)
  assert out["forward_macs_per_token"] == 10.0 and out["inference_flops_per_token"] == 2.0


def test_schedule_warms_up_then_decays_to_zero():
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"), "smoke")
  c.train.steps_per_epoch, c.optimizer.warmup_steps = 10, 4
  lr = optim.learning_rate(c.optimizer, 1.0, config_lib.stage_steps(c))
  np.testing.assert_allclose([float(lr(s)) for s in (0, 2, 4, 7, 10)],
                             [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)


def test_iid_flag_trains_once_on_all_megabatches_with_b_times_the_steps():
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_ens"),
                                  "smoke,iid")
  done = validation.complete(c)
  assert done.stream.wait == 4 and done.train.steps_per_epoch == 20
  again = validation.complete(done)  # idempotent
  assert again.stream.wait == 4 and again.train.steps_per_epoch == 20
  assert c.stream.wait == 1  # the input is not modified


def test_kx_variants_multiply_the_steps_per_stage():
  def steps(arg):
    return config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"),
                                       arg).train.steps_per_epoch
  assert steps("") == 120_000 and steps("2x") == 240_000 and steps("large,4x") == 480_000
  assert steps("quick") == 80 and steps("quick,2x") == 160 and steps("2x,quick") == 160
  for bad in ("0x", "x", "2y", "1.5x"):
    with pytest.raises(ValueError, match=f"config variant '{bad}' is unknown; valid: .*'Kx'"):
      steps(bad)


@pytest.mark.parametrize("path, value, message", [
    ("model.name", "mlp", r"config\.model\.name='mlp' cannot model text"),
    ("model.preset", "huge", r"config\.model\.preset='huge' is unknown; valid values"),
    ("optimizer.warmup_steps", 50, r"config\.optimizer\.warmup_steps=50"),
    ("stream.wait", 2, r"config\.stream\.iid=True with config\.stream\.wait=2"),
    ("model.width", 128, r"config\.model\.width=128 does not apply to the Switch Transformer .*"
                         r"allowed values: \[64\]"),
    ("model.init", "torch", r"config\.model\.init='torch' does not apply to the Switch "
                            r"Transformer .*allowed values: \['lecun'\]"),
    ("model.conv_impl", "xla", r"config\.model\.conv_impl='xla' does not apply"),
])
def test_bad_text_configs_name_the_field(path, value, message):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", "lm_sm"),
                                  "smoke,iid" if path == "stream.wait" else "smoke")
  *parents, leaf = path.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ConfigError, match=message):
    validation.validate(c)


def test_the_refused_image_model_fields_are_refused_only_away_from_their_defaults():
  defaults = {f.path: f.default for f in config_lib.BASE_FIELDS}
  assert {p: defaults[p] for p in text_task.IMAGE_MODEL_FIELDS} == text_task.IMAGE_MODEL_FIELDS


# -- whole runs ---------------------------------------------------------------------------------
# The vocabulary of the test runs (`config.data.vocab_size`): evaluating and training over
# GPT-2's 50,257 tokens is most of a smoke run's time once its programs are compiled. One run
# below keeps the whole vocabulary.
SMALL_VOCAB = 512


def smoke(method="lm_sm", vocab_size=SMALL_VOCAB, **fields):
  c = config_lib.apply_variant(config_lib.base_config("tiny_shakespeare", method), "smoke")
  c.mesh.num_devices = 1
  c.checkpoint.enabled = False
  c.data.vocab_size = vocab_size
  for path, value in fields.items():
    *parents, leaf = path.split("__")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def records(wd):
  return io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))


@requires_bpe
@requires_shakespeare
def test_smoke_run_on_tiny_shakespeare_writes_b_plus_1_records_with_falling_perplexity(
    tmp_path, monkeypatch):
  from alma_jax.reports import plots  # pylint: disable=g-import-not-at-top
  drawn = []
  monkeypatch.setattr(plots.PlotChild, "draw", lambda self, *a: drawn.append(a))
  wd = str(tmp_path / "run")
  summary = run_lib.run(smoke(vocab_size=0), wd)
  log = records(wd)
  # The run's own figure draws perplexity, named by the model's preset and experts, not a width.
  (path, curves, title, ylabel, scale), = drawn
  assert (ylabel, scale) == ("test perplexity", 1.0) and "width" not in title
  assert "preset=tiny" in title and curves[0][2] == [r["test_perplexity"] for r in log]
  assert [r["t"] for r in log] == [0, 1, 2, 3, 4]
  ppl = [r["test_perplexity"] for r in log]
  assert all(b < a for a, b in zip(ppl, ppl[1:])), ppl
  # The untrained model is near uniform over the 50,257 tokens.
  assert 0.8 * 50257 < ppl[0] < 1.25 * 50257
  assert summary["mean_perplexity"] == pytest.approx(np.mean(ppl[1:]))
  assert summary["final_bits_per_byte"] == pytest.approx(log[-1]["test_bits_per_byte"])
  assert summary["comp"] > 0 and summary["mem"] == sum(r["num_params"] for r in log)
  # 5 steps of 4 sequences per stage, each sequence L = 32 tokens.
  assert log[1]["train_macs"] == pytest.approx(log[1]["forward_macs_per_token"] * 5 * 4 * 32)
  with open(os.path.join(wd, "summary.json")) as f:
    assert json.load(f)["num_stages"] == 4


def test_a_cut_vocabulary_keeps_the_most_frequent_tokens_and_merges_the_rest():
  tokens = np.array([7, 3, 3, 9, 7, 3, 1, 9, 5], np.uint16)  # 3: 3 times; 7, 9: twice; 1, 5: once
  table = text_data.frequent_tokens(tokens, 12, 4)
  assert table.shape == (12,) and table.dtype == np.int32
  # By falling count, a tie to the smaller id; every other token (seen or not) is the last one.
  assert table[[3, 7, 9]].tolist() == [0, 1, 2]
  assert set(np.delete(table, [3, 7, 9]).tolist()) == {3}
  whole = text_data.frequent_tokens(tokens, 12, 12)  # unseen tokens in the order of their ids
  assert whole[[3, 7, 9, 1, 5, 0, 11]].tolist() == [0, 1, 2, 3, 4, 5, 11]
  with pytest.raises(ValueError, match="a vocabulary of 13 tokens cannot be cut from one of 12"):
    text_data.frequent_tokens(tokens, 12, 13)


@pytest.mark.parametrize("value", [1, -1, 50258])
def test_a_vocabulary_size_outside_its_range_is_refused(value):
  with pytest.raises(ConfigError, match=re.escape(
      f"config.data.vocab_size={value} must be 0 (GPT-2's whole vocabulary) or an integer in "
      "[2, 50257]")):
    validation.validate(smoke(vocab_size=value))


@requires_bpe
def test_a_text_file_by_path_works_the_same(tmp_path):
  lines = [f"Line {i}: the quick brown fox jumps over the lazy dog number {i % 7}.\n"
           for i in range(400)]
  path = tmp_path / "corpus.txt"
  path.write_text("".join(lines), encoding="utf-8")
  wd = str(tmp_path / "run")
  run_lib.run(smoke(data__text_file=str(path), data__name="corpus"), wd)
  ppl = [r["test_perplexity"] for r in records(wd)]
  assert len(ppl) == 5
  assert all(b < a for a, b in zip(ppl, ppl[1:])), ppl
  cached = os.listdir(os.path.join(os.environ["ALMA_JAX_CACHE_DIR"], "text"))
  assert any(n.startswith("file_") for n in cached)


def test_records_keep_the_task_fields_and_the_summary_averages_perplexity():
  def rec(t, ppl):
    return Record(t=t, test_error=0.5, num_params=10, train_flops=1.0, train_flops_forward=0.5,
                  train_macs=0.2, growth_flops=0.0, growth_macs=0.0,
                  inference_flops_per_example=3.0,
                  trained=t > 0, wall_s=0.1,
                  extra={"test_nll": math.log(ppl), "test_perplexity": ppl,
                         "test_bits_per_byte": ppl / 100, "forward_macs_per_token": 7.0,
                         "inference_flops_per_token": 9.0})

  log = Log.from_records([rec(0, 1000.0), rec(1, 40.0), rec(2, 20.0)])
  d = log.records[1].to_dict()
  assert d["test_perplexity"] == 40.0 and Record.from_dict(d) == log.records[1]
  task = text_task.TextTask(seq_len=8)
  s = task.summary(log.records)
  assert s["mean_perplexity"] == pytest.approx(30.0)
  assert s["mean_perplexity_with_t0"] == pytest.approx(1060.0 / 3)
  assert s["final_perplexity"] == 20.0 and s["mean_bits_per_byte"] == pytest.approx(0.3)
  assert not set(s) & set(log.summary())  # the task's fields come beside the log's
  assert task.progress(log.records[-1:]) == "test_ppl=20.000"
  assert task.summary_line(s).startswith("perplexity: mean over t=1..B 30.000, final 20.000")
  # Image records have no such fields: the summary and the lines are the ones they always were.
  plain = Log.from_records([Record.from_dict({k: v for k, v in r.to_dict().items()
                                              if k not in r.extra}) for r in log.records])
  assert task.summary(plain.records) == {} and plain.records[0].extra == {}
  assert task.progress(plain.records) == "" and task.summary_line(plain.summary()) == ""


def _strict_json(text):
  """`json.loads` that refuses NaN and Infinity (not JSON, though Python writes them)."""
  def refuse(name):
    raise ValueError(f"{name} is not valid JSON")
  return json.loads(text, parse_constant=refuse)


def _strict_records(wd):
  with open(os.path.join(wd, "log.jsonl")) as f:
    return [_strict_json(line) for line in f]


def test_a_huge_test_nll_gives_a_capped_perplexity_that_stays_valid_json():
  task = text_task.TextTask(32)
  task.test_target_tokens, task.test_target_bytes = 64, 200
  flops = {"train_macs_per_example": 32.0, "inference_per_example": 64.0}
  assert task.record_metrics(math.log(40.0), flops)["test_perplexity"] == pytest.approx(40.0)
  fields = task.record_metrics(17671.5, flops)  # exp overflows a float
  assert fields["test_perplexity"] == text_task.MAX_PERPLEXITY
  assert fields["test_nll"] == 17671.5
  records = [Record(t=t, test_error=0.9, num_params=10, train_flops=1.0, train_flops_forward=0.5,
                    train_macs=0.2, growth_flops=0.0, growth_macs=0.0,
                    inference_flops_per_example=3.0,
                    trained=t > 0, wall_s=0.1, extra=task.record_metrics(nll, flops))
             for t, nll in enumerate([10.8, 17671.5, 1e6])]
  summaries = [dict(Log.from_records(records).summary(), wall_s=1.0)] * 2
  for obj in [r.to_dict() for r in records] + summaries + [population.mean_summary(summaries)]:
    _strict_json(json.dumps(obj))


@requires_bpe
@requires_shakespeare
def test_a_huge_but_finite_loss_runs_on_with_capped_perplexities(tmp_path):
  # Adam's steps are at most the learning rate: the weights grow large, the loss stays finite
  # (no divergence), and the test NLL is far beyond what exp can take.
  wd = str(tmp_path / "run")
  summary = run_lib.run(smoke(optimizer__kwargs__learning_rate=30.0), wd)
  ppl = [r["test_perplexity"] for r in _strict_records(wd)]
  assert len(ppl) == 5 and ppl[-1] == text_task.MAX_PERPLEXITY, ppl
  assert summary["final_perplexity"] == text_task.MAX_PERPLEXITY
  with open(os.path.join(wd, "summary.json")) as f:
    _strict_json(f.read())


@requires_bpe
@requires_shakespeare
def test_a_non_finite_loss_diverges_or_rolls_back_as_for_images(tmp_path, caplog):
  with pytest.raises(DivergenceError, match=r"^stage t=1 epoch 1: non-finite training loss"):
    run_lib.run(smoke(optimizer__kwargs__learning_rate=1e30), str(tmp_path / "raise"))
  wd = str(tmp_path / "rollback")
  run_lib.run(smoke(optimizer__kwargs__learning_rate=1e30, train__on_divergence="rollback"), wd)
  assert "stage t=1 epoch 1: non-finite loss or parameters; rolling back" in caplog.text
  records = _strict_records(wd)
  assert [r["t"] for r in records] == [0, 1, 2, 3, 4]
  # Every stage rolled back to its start: the untrained model's perplexity throughout.
  assert all(r["test_perplexity"] == records[0]["test_perplexity"] for r in records)


@requires_bpe
def test_a_mistyped_text_data_set_name_gets_the_name_it_is_close_to(tmp_path):
  with pytest.raises(text_data.images.DatasetUnavailableError,
                     match=r"config\.data\.name='tiny_shakespear' is not a tfds data set .*; did "
                     r"you mean 'tiny_shakespeare'\?$"):
    text_data.load_corpus(name="tiny_shakespear", text_file=None, bpe_folder=BPE,
                          data_dir=str(tmp_path), cache_dir=str(tmp_path / "c"), download="no")


# -- tiktoken's own gpt2 encoding when no BPE folder is given --------------------------------------
def _tiktoken_cache(tmp_path, monkeypatch, filled=True):
  """A tiktoken cache of its own (pre-filled from the local BPE files: no download), no BPE
  folder configured."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  cache = tmp_path / "tiktoken"
  cache.mkdir()
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
  monkeypatch.delenv(text_data.BPE_DIR_ENV, raising=False)
  if filled:
    for name in text_data.BPE_FILES:  # tiktoken names a download by the SHA-1 of its URL
      key = hashlib.sha1((text_data.BPE_URL + name).encode()).hexdigest()
      assert text_data.tiktoken_cache_file(name) == str(cache / key)
      shutil.copy(os.path.join(BPE, name), cache / key)
  return cache


@requires_bpe
def test_without_a_bpe_folder_tiktoken_s_gpt2_gives_the_same_tokens(tmp_path, monkeypatch):
  local = text_data.load_tokenizer(text_data.bpe_dir(BPE))
  _tiktoken_cache(tmp_path, monkeypatch)
  monkeypatch.setattr(text_data.images, "internet_reachable",
                      lambda *a, **k: pytest.fail("probed the internet"))
  folder = text_data.bpe_dir(None)
  assert folder == text_data.TIKTOKEN_GPT2
  enc = text_data.load_tokenizer(folder)
  assert enc.n_vocab == text_data.VOCAB_SIZE
  np.testing.assert_array_equal(text_data.encode(enc, SAMPLE), text_data.encode(local, SAMPLE))
  # The same files: the same token cache.
  assert text_data.tokenizer_digest(folder) == text_data.tokenizer_digest(BPE)
  # A folder given wins.
  monkeypatch.setenv(text_data.BPE_DIR_ENV, BPE)
  assert text_data.bpe_dir(None) == BPE


@requires_bpe
def test_offline_without_files_the_error_says_where_to_get_them(tmp_path, monkeypatch):
  cache = _tiktoken_cache(tmp_path, monkeypatch, filled=False)
  monkeypatch.setattr(text_data.images, "internet_reachable", lambda *a, **k: False)
  message = (r"config\.data\.bpe_dir is not set, \$ALMA_JAX_BPE_DIR is empty, and tiktoken's "
             rf"gpt2 encoding is not in its cache \({cache}\) and cannot be downloaded \(no "
             r"internet connection\); download https://openaipublic\.blob\.core\.windows\.net/"
             r"gpt-2/encodings/main/encoder\.json and .*/vocab\.bpe into a folder and set "
             r"config\.data\.bpe_dir \(or \$ALMA_JAX_BPE_DIR\) to it")
  with pytest.raises(text_data.TokenizerUnavailableError, match=message):
    text_data.bpe_dir(None)
  c = smoke(data__cache_dir=str(tmp_path / "no_token_cache"))  # (a token cache would serve)
  with pytest.raises(ConfigError, match=message):
    validation.validate(c)
  # A damaged download in the cache counts as none.
  for name in text_data.BPE_FILES:
    with open(text_data.tiktoken_cache_file(name), "w") as f:
      f.write("{}")
  with pytest.raises(text_data.TokenizerUnavailableError, match="not in its cache"):
    text_data.bpe_dir(None)


@requires_bpe
def test_loads_that_start_together_tokenise_a_corpus_once(tmp_path, monkeypatch):
  """Two loads of one corpus on a fresh cache: one tokenises and writes the token cache, the
  other waits for it and reads it (threads stand for processes: flock locks belong to an
  open file, which each load opens anew)."""
  path = tmp_path / "corpus.txt"
  path.write_text("".join(f"Line {i}: a few words of text.\n" for i in range(200)),
                  encoding="utf-8")
  read, calls = text_data._file_text, []  # pylint: disable=protected-access

  def slow_read(p):
    calls.append(p)
    time.sleep(0.5)  # long enough for the other load to reach the lock
    return read(p)

  monkeypatch.setattr(text_data, "_file_text", slow_read)
  cache, results = str(tmp_path / "cache"), [None, None]

  def load(i):
    results[i] = text_data.load_corpus(name="corpus", text_file=str(path), bpe_folder=BPE,
                                       cache_dir=cache)

  threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert calls == [str(path)]
  assert sorted(r.timings["source"] for r in results) == ["cache", "tokenised"]
  for f in ("train_tokens", "test_tokens", "test_bytes"):
    np.testing.assert_array_equal(getattr(results[0], f), getattr(results[1], f))
  assert len(results[0].train_tokens) > 0
  [lock] = os.listdir(os.path.join(cache, ".locks"))  # apart from the token caches
  assert lock.startswith("tokens_file_") and lock.endswith(".lock")
  assert not any(n.endswith(".lock") for n in os.listdir(os.path.join(cache, "text")))
