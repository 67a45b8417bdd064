"""The worker side: flat parameter/gradient buffers and the CLI training loop."""
