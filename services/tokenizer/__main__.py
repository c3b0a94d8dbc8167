from services.tokenizer.main import main

main()
