//! Advantage estimators, reward normalisation, filters, losses, optimiser (issue 6).
