"""docs/backends.md's "The interface", runnable: python examples/drive_a_backend.py (one process, a few seconds).

Drives a back end by hand through one optimizer step, in the order the engine does, and checks the result against
plain torch: one SGD step on the mean loss of the window's 10 samples taken as one batch. A back end of your own can
be dropped into the same order (accum_sched.backends.make_backend picks the one-process back end here)."""
import torch

from accum_sched import window_stats
from accum_sched.backends import make_backend

torch.manual_seed(0)
x_all, y_all = torch.randn(10, 4), torch.randn(10, 1)
micro_batches = [(x_all[:4], y_all[:4]), (x_all[4:8], y_all[4:8]), (x_all[8:], y_all[8:])]  # 4 + 4 + 2 samples
model = torch.nn.Linear(4, 1)
reference = torch.nn.Linear(4, 1)
reference.load_state_dict(model.state_dict())

backend = make_backend(model, torch.optim.SGD(model.parameters(), lr=0.1))
factor = size = len(micro_batches)
samples = elements = len(x_all)              # a per-sample loss: elements are samples
want_norm = True                             # the engine asks for the norm where it clips or checks it
loss_so_far = torch.zeros((), dtype=torch.float64)

for j, (x, y) in enumerate(micro_batches):               # the window's micro-batches
    boundary = j == size - 1
    with backend.sync_context(boundary=boundary):         # before the forward; held around forward AND backward
        loss = ((model(x) - y) ** 2).sum()                # the user's forward: a sum of per-sample losses
        loss_so_far = loss_so_far + loss.detach().double()
        if boundary:                                      # the window's numbers, to be summed over ranks
            stats = window_stats.encode(elements, samples, loss_so_far, False, backend.stats_dtype, x.device)
            backend.send_window_stats(stats, want_norm)
        backend.backward(loss)
stats, squared_norm = backend.window_totals(want_norm)   # device tensors: one host transfer per step
totals = window_stats.decode(stats.tolist())
norm = squared_norm.sqrt().item()                         # the un-normalised gradient's global norm
coef, max_norm, skip, lr_scale = 1 / totals.elements, None, False, 1.0   # the engine's: divide by the global count
backend.on_window(factor, size, samples)
backend.step(coef, max_norm, norm, skip, lr_scale)

reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
((reference(x_all) - y_all) ** 2).mean().backward()      # the large batch: every sample of the window at once
reference_optimizer.step()
print(f"window totals: {totals.elements} elements, {totals.samples} samples, loss sum {totals.loss:.4f}")
same = all(torch.allclose(p, q, atol=1e-7, rtol=0) for p, q in zip(model.parameters(), reference.parameters()))
print(f"one optimizer step equals the large-batch reference: {same}")
print(f"gradient cleared after the step: {all(p.grad is None or not p.grad.any() for p in model.parameters())}")
