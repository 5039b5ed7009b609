"""The in-sandbox agent: standard library only, never imports the host code.

Inside a sandbox this directory is mounted as the package ``mcs_agent``; its modules use
relative imports only, so the same files work as ``mcp_code_sandbox.agent`` on the host.
"""
