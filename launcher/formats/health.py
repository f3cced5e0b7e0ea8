"""The node health labels: what `launch preflight drain` puts on a failed Kubernetes node and what a
rendered TrainJob's node affinity selects against. One definition, so the two never disagree (checks
writes the label, launcher/render reads it; neither imports the other).
"""

from __future__ import annotations

#: label (and NoSchedule taint) key on a drained node; its value is "fail"
HEALTH_KEY = "launch4d.io/health"
#: annotation key holding why the node was drained (a label value cannot hold the text)
REASON_KEY = "launch4d.io/reason"
