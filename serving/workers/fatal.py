"""The end of an instance whose engine can never serve again (a tensor-parallel rank died or hung: issue #45).

Such an engine fails every request at once, for good; an instance left up would keep answering each request
with that error while its health says READY. ``exit_process_soon`` ends the process instead, as a crashed stub
ends: inside tritonserver, the stub guardian (``serving.triton.stub_guardian``) sees its stub's pipe close
without ``finalize`` and ends the server, whose supervisor starts it again, and the fleet's routers stop
pairing the instance meanwhile (its rendezvous refuses connections). The grace lets the error responses
already handed to the response thread leave first.
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

#: Exit status of an instance ended this way (``EX_SOFTWARE``).
EXIT_STATUS = 70
#: Time between the failure and the exit, seconds: the failed requests' error responses leave meanwhile.
GRACE_S = 2.0


def exit_process_soon(error: BaseException, grace_s: float = GRACE_S) -> threading.Thread:
    """Log ``error`` and end this process with ``EXIT_STATUS`` ``grace_s`` seconds from now (``os._exit``: no
    finalizer runs, as in a crash; rank processes end with their parent's pipe, a memfd leaves nothing
    behind). Returns the daemon thread (``instance-exit``) that will do it. Never raises."""
    logger.critical("the engine failed for good (%s): this process exits in %.1f s so that it is replaced",
                    error, grace_s)

    def end() -> None:
        time.sleep(grace_s)
        logging.shutdown()
        os._exit(EXIT_STATUS)

    thread = threading.Thread(target=end, name="instance-exit", daemon=True)
    thread.start()
    return thread
