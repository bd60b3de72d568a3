"""Script mode charges the time between a step's ops to the script's own line (issue 24): a
training script, unchanged, that sorts with NumPy inside its step."""

import textwrap

from perfloop.workflows.script import profile_script

SCRIPT = textwrap.dedent("""
    import numpy as np
    import torch

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    for step in range(6):
        noise = np.sort(rng.standard_normal(1_500_000))[:64].astype(np.float32)  # the planted work
        loss = model(torch.from_numpy(noise).expand(8, 64)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_numpy_inside_a_scripts_step_is_charged_to_its_line(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    line = next(i for i, t in enumerate(SCRIPT.splitlines(), 1) if "np.sort" in t)
    p = profile_script(str(path), skip=1, steps=2)
    top = p.diagnose(ceilings={}).opportunities[0]
    assert "host work outside torch" in top.title, str(top)
    assert f"train.py:{line} (<module>)" in top.where, str(top)
