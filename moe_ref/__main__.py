from moe_ref.tools.cli import main

raise SystemExit(main())
