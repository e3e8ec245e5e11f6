"""Helper modules for tests that need importable autograd.Functions (archives,
graph passes, the CLI). Importing a module here registers its opaque ops."""
