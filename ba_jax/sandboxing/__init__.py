"""Running untrusted programs: namespaces, a read-only file system and
resource limits (``sandbox`` on the host; ``sandbox_launcher`` and
``sandbox_harness`` are copied into each run and use the standard library
only).

May import: config.
"""
