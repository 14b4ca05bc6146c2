from moe_ref.cli import main

raise SystemExit(main())
