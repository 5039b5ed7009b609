from mcp_code_sandbox.cli import main

raise SystemExit(main())
