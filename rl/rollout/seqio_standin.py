"""Lets JetStream import without seqio (and the TensorFlow stack seqio pulls in).

google-jetstream 0.2.2 imports `seqio.vocabularies` in `jetstream.engine.token_utils` and
`mock_utils` for its own tokenizer helpers; the orchestrator imports token_utils, so the
whole TensorFlow stack came with it: 15-19 s and ~0.7 GB per importing process on a 2-core
host, and about a third of a clean install. This project serves token ids (its engine
implements `tokenizer_api` itself) and never calls those helpers, so the Makefile installs
JetStream without its dependencies and, where seqio is absent, this registers a module that
satisfies the import and refuses any use. Where seqio is installed, it is left alone.
"""
import importlib.util
import sys
import types


class _Unavailable:
  """Base of the stand-in vocabularies: subclassing works, constructing raises."""

  def __init__(self, *args, **kwargs):
    raise RuntimeError(
        f"{type(self).__name__}: seqio is not installed; JetStream's seqio tokenizer helpers "
        "are not used by this project (its engine serves token ids)")


def install_if_missing() -> bool:
  """Registers `seqio` and `seqio.vocabularies` stand-ins when seqio is not importable.
  Returns whether it did."""
  if "seqio" in sys.modules:
    return False
  try:
    if importlib.util.find_spec("seqio") is not None:
      return False
  except ImportError:  # a finder that refuses seqio: treat it as absent
    pass
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = type("Vocabulary", (_Unavailable,), {})
  vocabularies.SentencePieceVocabulary = type("SentencePieceVocabulary",
                                              (vocabularies.Vocabulary,), {})
  seqio = types.ModuleType("seqio")
  seqio.__path__ = []          # a package, so `from seqio.vocabularies import ...` resolves
  seqio.vocabularies = vocabularies
  seqio.__doc__ = vocabularies.__doc__ = "stand-in: see rl/rollout/seqio_standin.py"
  sys.modules["seqio"] = seqio
  sys.modules["seqio.vocabularies"] = vocabularies
  return True
