"""Running untrusted programs: namespaces, a bare read-only root and hard limits
(``sandbox`` on the host, with ``cgroups`` and ``cleanup``; ``sandbox_launcher``,
``sandbox_seccomp`` and ``sandbox_harness`` run inside and use the standard
library only), and tests judged where the program cannot reach (``judge``,
``outputs``).

May import: config.
"""
