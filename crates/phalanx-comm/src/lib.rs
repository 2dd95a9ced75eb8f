//! phalanx-comm: process groups, collectives, transports and the rendezvous store.
