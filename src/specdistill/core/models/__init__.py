"""Models: the target, the three kinds of draft, the KV cache and the feature taps they share."""

from __future__ import annotations

import transformers
from packaging.version import Version

# transformers 5.24 renamed the forward's `past_key_values` to `cache`. The decoder passes `cache=`; an
# older version takes it as an unknown keyword and silently runs without the KV cache, so speculative
# decoding stops being lossless (seen with 5.17-5.23). Refuse those versions before anything runs.
MIN_TRANSFORMERS = "5.24"


def require_transformers(version: str = transformers.__version__) -> None:
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"specdistill needs transformers>={MIN_TRANSFORMERS} (found {version}): older versions "
                          "ignore the KV cache the decoder passes as `cache=`. Upgrade with "
                          f"pip install -U 'transformers>={MIN_TRANSFORMERS},<6'")


require_transformers()
