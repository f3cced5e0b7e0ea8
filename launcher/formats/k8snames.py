"""Kubernetes object names (RFC 1123), as the API server checks them: the one rule for the manifests
launcher/render writes and the preflight pods checks/runners/k8s.py creates.
"""

from __future__ import annotations

import re

#: a label-style name (namespaces, most objects): at most 63 characters, checked by the caller
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: a DNS subdomain (node and pod names): dot-separated labels, at most 253 characters
RFC1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
