"""Build time only: the bwrap runtime venv, Node.js, the sandbox image and the server image.

Used by ``setup`` and ``image build``; the request path never imports this package.
"""
