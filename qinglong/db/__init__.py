"""Database backends of the control plane (DATABASES' ENGINE)."""
