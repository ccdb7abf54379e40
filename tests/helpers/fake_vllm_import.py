"""What `import vllm` does to the stand-in: it takes time, and it configures logging as it imports
(vllm/logger.py applies VLLM_LOGGING_CONFIG_PATH at import time). Imported once per interpreter, so
a standby that imported it already pays neither again (and must re-apply the logging config itself).
"""

import json
import logging.config
import os
import time

time.sleep(float(os.environ.get("FAKE_VLLM_IMPORT_DELAY", "0")))
IMPORT_ENV = dict(os.environ)  # what the import read: torch's inductor config, say, reads its variables once
_path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
CONFIGURED = os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "1" and bool(_path)
if CONFIGURED:
    with open(str(_path)) as f:
        logging.config.dictConfig(json.load(f))
