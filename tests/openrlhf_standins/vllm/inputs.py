TokensPrompt = dict
