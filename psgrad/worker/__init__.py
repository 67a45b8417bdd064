"""The worker side: flat parameter/gradient buffers, PSOptimizer's torch.optim face and step statistics, and the CLI training loop."""
