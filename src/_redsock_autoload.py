"""torch's ``torch.backends`` entry point for redsock, kept outside the package on purpose.

torch calls it at ``import torch`` and turns any exception — including one raised
while importing ``redsock`` itself — into a failed ``import torch``.  Importing the
package here, inside the try, means a broken redsock can never break torch.
"""

import logging


def autoload() -> None:
    try:
        # The submodule, not the package: `import redsock.torch` may itself be what is
        # importing torch right now, so the package can be half-initialised here.
        from redsock.torch.registration import autoload as register
        register()
    except Exception:
        logging.getLogger("redsock").warning("redsock: the torch backend could not be registered", exc_info=True)
