"""Where the template relies on Lightning's (or torch's, torchmetrics') private behaviour, each place with its
version and canary.

Each entry was measured on Lightning 2.6.6 with torch 2.14.1. Its docstring gives that version, the reason in one
line, and the name of its canary in engine/tests/test_lightning_workarounds.py. A canary runs plain Lightning
WITHOUT the workaround and asserts the behaviour that made the workaround necessary (or the private API it relies
on). The modules here hold one concern each (launch, precision, loggers, dcp); what each entry
needs of private code is checked in gates.py.
A callback that reads or repairs private state to do its work lives in callbacks/ and names its canary the same way
(callbacks/exact_metrics.py, callbacks/loop_repairs.py, callbacks/preemption.py, callbacks/ema.py).

Private names are imported where they are used, never when a module is: a Lightning release without one breaks no
import. Where a public fallback gives the same result, it runs instead; where none does, the job that needs the
workaround refuses to start in one line (`gates.require`).

When a canary fails after an upgrade, Lightning changed that behaviour: delete that workaround (and its canary),
use Lightning's own behaviour or public API instead, and run the tests that name the entry.
"""
