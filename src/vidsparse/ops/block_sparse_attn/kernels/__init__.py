"""The engine's ``@triton.jit`` / ``@gluon.jit`` code: launchers live one folder up."""
