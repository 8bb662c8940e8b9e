from workbook.cli import main

raise SystemExit(main())
