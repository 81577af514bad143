"""What every part uses: the settings, the service's errors, metrics, traces, thread names, and a request's deadline and
priority.

Imports no other part of the service.
"""
