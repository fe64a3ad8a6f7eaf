"""Packaging: pyproject metadata, the configs in the wheel, and configs named by name."""

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

from packaging.requirements import Requirement
import pytest

from alma_jax.configuration import config_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
# In requirements.txt for the tests and the report; optional in the package (extras).
_EXTRA_ONLY = {"matplotlib": "report", "pandas": "report", "tensorboard": "tensorboard",
               "wandb": "wandb", "pytest": "dev", "pytest-xdist": "dev"}


def _pyproject():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _pins():
  """{normalised name: Requirement} of requirements.txt."""
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    lines = [l.split("#", 1)[0].strip() for l in f]
  reqs = [Requirement(l) for l in lines if l]
  return {_norm(r.name): r for r in reqs}


def _norm(name: str) -> str:
  return name.lower().replace("_", "-")


def _declared(reqs):
  """{normalised name: Requirement} of the entries whose marker holds here."""
  parsed = [Requirement(r) for r in reqs]
  return {_norm(r.name): r for r in parsed if r.marker is None or r.marker.evaluate()}


def _pinned_version(req: Requirement) -> str | None:
  exact = [s.version for s in req.specifier if s.operator == "=="]
  return exact[0] if exact else None


# -- pyproject.toml -----------------------------------------------------------------------------
def test_dependencies_cover_every_pin_with_a_range_that_contains_it():
  deps = _declared(_pyproject()["project"]["dependencies"])
  for name, pin in _pins().items():
    if name in _EXTRA_ONLY:
      assert name not in deps, f"{name} is optional (extra [{_EXTRA_ONLY[name]}])"
      continue
    assert name in deps, f"requirements.txt pins {name}; pyproject.toml does not declare it"
    version = _pinned_version(pin)
    if version:
      assert deps[name].specifier.contains(version), (name, str(deps[name].specifier), version)
      assert "==" not in str(deps[name].specifier), f"{name}: a range, not a pin"


def test_tensorflow_cpu_where_it_has_wheels_and_tensorflow_elsewhere():
  deps = [Requirement(r) for r in _pyproject()["project"]["dependencies"]]
  tf = {r.name: r.marker for r in deps if r.name in ("tensorflow-cpu", "tensorflow")}
  cases = [("linux", "x86_64", "tensorflow-cpu"), ("win32", "AMD64", "tensorflow-cpu"),
           ("linux", "aarch64", "tensorflow"), ("darwin", "arm64", "tensorflow")]
  for platform, machine, wanted in cases:
    env = {"sys_platform": platform, "platform_machine": machine}
    chosen = [name for name, marker in tf.items() if marker.evaluate(env)]
    assert chosen == [wanted], (platform, machine, chosen)


def test_extras():
  extras = _pyproject()["project"]["optional-dependencies"]
  assert set(extras) == {"cuda", "tpu", "report", "tensorboard", "wandb", "dev"}
  jax_pin = _pinned_version(_pins()["jax"])
  cuda = Requirement(*extras["cuda"])
  assert cuda.name == "jax" and cuda.extras == {"cuda12"} and _pinned_version(cuda) == jax_pin
  tpu = Requirement(*extras["tpu"])
  assert tpu.name == "jax" and tpu.extras == {"tpu"} and tpu.specifier.contains(jax_pin)
  named = {k: {_norm(Requirement(r).name) for r in v} for k, v in extras.items()}
  assert named["report"] == {"matplotlib", "pandas"}
  assert named["tensorboard"] == {"tensorboard"}
  assert named["wandb"] == {"wandb"}
  assert named["dev"] == {"pytest", "pytest-xdist"}
  for extra in ("report", "tensorboard", "wandb"):  # the tested pins lie in the extras' ranges
    for r in map(Requirement, extras[extra]):
      pin = _pins().get(_norm(r.name))
      version = None if pin is None else _pinned_version(pin)
      assert version is None or r.specifier.contains(version), (extra, r, pin)


def test_console_script_is_the_module_entry_point():
  project = _pyproject()["project"]
  assert project["scripts"] == {"alma-jax": "alma_jax.main:console"}
  with open(os.path.join(ROOT, "alma_jax", "main.py")) as f:
    tree = ast.parse(f.read())
  functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
  assert "console" in functions
  guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
  assert len(guard) == 1 and ast.unparse(guard[0].body[0]) == "console()"


def test_every_package_and_config_folder_is_listed_for_setuptools():
  setup = _pyproject()["tool"]["setuptools"]
  assert setup["package-dir"] == {"alma_jax.configs": "configs", "alma_jax.launch": "launch",
                                  "alma_jax.launch.grids": "launch/grids"}
  wanted = set()
  for parent, _, files in os.walk(os.path.join(ROOT, "alma_jax")):
    if "__init__.py" in files:
      wanted.add(os.path.relpath(parent, ROOT).replace(os.sep, "."))
  for parent, subdirs, files in os.walk(CONFIGS):
    subdirs[:] = [d for d in subdirs if not d.startswith(("_", "."))]
    if any(f.endswith(".py") for f in files):
      rel = os.path.relpath(parent, CONFIGS)
      wanted.add("alma_jax.configs" + ("" if rel == "." else "." + rel.replace(os.sep, ".")))
  wanted |= {"alma_jax.launch", "alma_jax.launch.grids"}  # launch/ and launch/grids/
  assert set(setup["packages"]) == wanted
  assert not os.path.exists(os.path.join(ROOT, "alma_jax", "configs")), (
      "the experiment files live in the top-level configs/ only")
  assert not os.path.exists(os.path.join(ROOT, "alma_jax", "launch")), (
      "the launchers live in the top-level launch/ only")


def test_project_files_exist():
  with open(os.path.join(ROOT, "LICENSE")) as f:
    text = f.read()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  for name in ("CITATION.cff", "CHANGELOG.md", "CONTRIBUTING.md"):
    assert os.path.getsize(os.path.join(ROOT, name)) > 0, name
  assert _pyproject()["project"]["license"] == "Apache-2.0"


def test_wheel_ships_the_configs_the_launchers_and_the_console_script(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  for name in ("alma_jax", "configs", "launch"):
    shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
  out = tmp_path / "wheel"
  # Built in isolation: pip brings the setuptools that pyproject.toml asks for (a fresh
  # virtualenv's own is older) from the package index.
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                  str(src)], check=True, capture_output=True, timeout=300)
  (wheel,) = out.glob("alma_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = z.read(f"{info}/entry_points.txt").decode()
  wanted = {f"alma_jax/configs/{n}.py" for n in config_files.available(CONFIGS)}
  assert len(wanted) >= 16 and wanted <= names
  assert "alma_jax/configuration/config_files.py" in names and "alma_jax/methods/sm.py" in names
  launchers = {f"alma_jax/launch/{n}.py" for n in ("sweep", "sweep_state", "local", "slurm",
                                                    "tpu_pod")}
  grids = {f"alma_jax/launch/grids/{n}" for n in os.listdir(os.path.join(ROOT, "launch", "grids"))
           if n.endswith(".py")}
  assert launchers | grids <= names, sorted((launchers | grids) - names)
  assert f"{info}/licenses/LICENSE" in names
  assert "alma-jax = alma_jax.main:console" in entry_points
  assert not any(n.startswith(("configs/", "tests/", "launch/")) for n in names)


# -- configs by name --------------------------------------------------------------------------
@pytest.fixture(name="folder")
def _folder(tmp_path):
  """A configs folder of its own: two files and a subfolder."""
  root = tmp_path / "configs"
  (root / "bench").mkdir(parents=True)
  for rel in ("mnist_sm.py", "mnist_gmoe.py", "bench/p3_mnist_sm.py", "bench/_helper.py"):
    (root / rel).write_text("def get_config(arg=None):\n  return None\n")
  (root / "notes.txt").write_text("")
  return str(root)


def test_available_names(folder):
  assert config_files.available(folder) == ["bench/p3_mnist_sm", "mnist_gmoe", "mnist_sm"]
  names = config_files.available()
  assert {"mnist_sm", "cifar_gens", "lm_gmoe", "bench/p3_mnist_sm"} <= set(names)


@pytest.mark.parametrize("value,wanted", [
    ("mnist_sm", "mnist_sm.py"),
    ("mnist_sm.py", "mnist_sm.py"),
    ("mnist_sm:quick", "mnist_sm.py:quick"),
    ("mnist_sm.py:smoke,iid", "mnist_sm.py:smoke,iid"),
    ("configs/mnist_gmoe.py:quick", "mnist_gmoe.py:quick"),
    ("bench/p3_mnist_sm", os.path.join("bench", "p3_mnist_sm.py")),
])
def test_a_name_resolves_to_its_file(folder, tmp_path, monkeypatch, value, wanted):
  monkeypatch.chdir(tmp_path / "configs" / "bench")  # where none of these paths exists
  assert config_files.resolve(value, folder) == os.path.join(folder, wanted)


def test_an_existing_path_wins(folder, tmp_path, monkeypatch):
  (tmp_path / "work").mkdir()
  monkeypatch.chdir(tmp_path / "work")
  with open("mnist_sm.py", "w") as f:
    f.write("")
  assert config_files.resolve("mnist_sm.py:quick", folder) == "mnist_sm.py:quick"
  assert config_files.resolve("mnist_sm:quick", folder) == os.path.join(
      folder, "mnist_sm.py:quick")
  monkeypatch.chdir(ROOT)
  assert config_files.resolve("configs/mnist_sm.py:smoke") == "configs/mnist_sm.py:smoke"


def test_an_unknown_name_lists_the_names_and_suggests_close_ones(folder):
  with pytest.raises(config_files.UnknownConfigError) as e:
    config_files.resolve("mnsit_sm:smoke", folder)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("--config=mnsit_sm:smoke: ")
  assert "did you mean 'mnist_sm'?" in msg
  assert msg.endswith("Available names: bench/p3_mnist_sm, mnist_gmoe, mnist_sm")
  with pytest.raises(config_files.UnknownConfigError, match="did you mean 'bench/p3_mnist_sm'"):
    config_files.resolve("p3_mnst_sm", folder)  # a subfolder's file, by its basename
  with pytest.raises(config_files.UnknownConfigError) as e:
    config_files.resolve("cifar_vit", folder)
  assert "did you mean" not in str(e.value)


def test_suggestions_keep_only_the_closest_names():
  names = config_files.available(CONFIGS)
  assert config_files.suggestions("mnsit_sm", names) == ["mnist_sm"]
  assert config_files.suggestions("cifr_gmoe", names) == ["cifar_gmoe"]
  assert config_files.suggestions("xyz", names) == []


def test_argv_rewrites_only_the_config_flag(folder):
  argv = ["prog", "--config=mnist_sm:quick", "--config.seed=1", "--workdir=mnist_sm", "--",
          "--config=mnist_gmoe"]
  assert config_files.resolve_argv(argv, folder) == [
      "prog", f"--config={os.path.join(folder, 'mnist_sm.py')}:quick", "--config.seed=1",
      "--workdir=mnist_sm",
      "--", "--config=mnist_gmoe"]
  assert config_files.resolve_argv(["prog", "--config", "mnist_gmoe", "-config=mnist_sm"],
                                   folder) == [
      "prog", "--config", os.path.join(folder, "mnist_gmoe.py"),
      f"-config={os.path.join(folder, 'mnist_sm.py')}"]
  # The value as written, of the last flag before `--` (the one the flag parser keeps).
  assert config_files.config_value(argv) == "mnist_sm:quick"
  assert config_files.config_value(["prog", "--config", "mnist_gmoe", "-config=mnist_sm"]) == (
      "mnist_sm")
  assert config_files.config_value(["prog", "--config.seed=1", "--", "--config=x"]) is None


def test_an_unknown_name_exits_with_code_2_and_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    config_files.resolve_argv_or_exit(["prog", "--config=mnsit_sm:smoke"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("alma_jax: error: --config=mnsit_sm:smoke")


def test_the_installed_copy_comes_first(tmp_path, monkeypatch):
  package = tmp_path / "site" / "alma_jax"
  (tmp_path / "site" / "configs").mkdir(parents=True)  # as in a checkout: beside the package
  monkeypatch.setattr(config_files, "_PACKAGE_DIR", str(package))
  assert config_files.configs_dir() == str(tmp_path / "site" / "configs")
  (package / "configs").mkdir(parents=True)
  assert config_files.configs_dir() == str(package / "configs")
  monkeypatch.setattr(config_files, "_PACKAGE_DIR", str(tmp_path / "elsewhere" / "alma_jax"))
  assert config_files.configs_dir() is None
  with pytest.raises(config_files.UnknownConfigError, match="none \\(no configs folder found\\)"):
    config_files.resolve("mnist_sm")


# -- the entry point --------------------------------------------------------------------------
def _main(tmp_path, *flags):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  cmd = [sys.executable, "-m", "alma_jax.main", *flags]
  return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_main_reports_a_mistyped_name_before_starting(tmp_path):
  workdir = tmp_path / "run"
  p = _main(tmp_path, "--config=mnsit_sm:smoke", f"--workdir={workdir}")
  assert p.returncode == 2, p.stderr
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("alma_jax: error: --config=mnsit_sm:smoke: ")
  assert "did you mean 'mnist_sm'?" in last
  assert not workdir.exists()


def test_main_loads_a_config_by_name_from_any_directory(tmp_path):
  # An unknown override is reported once the file has loaded, before anything runs.
  workdir = tmp_path / "run"
  p = _main(tmp_path, "--config=mnist_sm:smoke", f"--workdir={workdir}",
            "--config.no_such_field=1")
  assert p.returncode == 2, p.stderr
  last = p.stderr.strip().splitlines()[-1]
  assert "no field 'no_such_field'" in last and "its fields:" in last
  assert os.path.join(CONFIGS, "mnist_sm.py:smoke") in last
  assert not workdir.exists()


def test_a_directory_is_never_a_config_file(folder, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "mnist_sm").mkdir()  # e.g. the workdir of `--config=mnist_sm --workdir=mnist_sm`
  assert config_files.resolve("mnist_sm:smoke", folder) == os.path.join(folder,
                                                                        "mnist_sm.py:smoke")
  (tmp_path / "runs").mkdir()
  with pytest.raises(config_files.UnknownConfigError,
                     match=r"^--config=runs:smoke: 'runs' is a directory, not a config file"):
    config_files.resolve("runs:smoke", folder)
