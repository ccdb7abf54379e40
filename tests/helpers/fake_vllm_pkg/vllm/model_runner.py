"""What the stand-in's EngineCore imports beyond its API server, as vLLM's imports its model runner, attention
backends and torch.compile's machinery: FAKE_VLLM_CORE_IMPORT_DELAY seconds (default 0). A standby imports it
ahead from the engines' module list (supervisor/child/vllm_standby.py import_engine_modules).

FAKE_VLLM_CORE_IMPORT_ENV="K=V,...": the import sets these in its process's environment, as some of vLLM's
modules do at import; the EngineCore logs what it finds.
"""

import os
import time

time.sleep(float(os.environ.get("FAKE_VLLM_CORE_IMPORT_DELAY", "0")))
for _pair in filter(None, os.environ.get("FAKE_VLLM_CORE_IMPORT_ENV", "").split(",")):
    _key, _, _value = _pair.partition("=")
    os.environ[_key] = _value
IMPORTED_IN = os.getpid()
