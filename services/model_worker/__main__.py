from services.model_worker.main import main

main()
