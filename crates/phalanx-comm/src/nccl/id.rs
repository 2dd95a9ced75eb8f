//! The NCCL unique id's trip through Phalanx's store: group rank 0 makes it
//! (`ncclGetUniqueId`) and sets it under the group's key; the other ranks
//! wait for the key and read it. The store is the job's authenticated one
//! (or torchrun's agent store), the same rendezvous as the native mesh.
//!
//! Status: the encoding and the exchange are unit-tested on CPU with a fake
//! id; not yet run on GPU hardware.

use crate::error::{CommError, Result};
use crate::store::StoreClient;
use std::time::Instant;

/// Bytes in an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;
/// What a stored id starts with: a tag and a format version.
const MAGIC: &[u8; 8] = b"PHXNCCL1";

/// The store key of a group's id (`gid` is the same on every member).
pub fn key(prefix: &str, gid: u64) -> String {
    format!("{prefix}/nccl/{gid:016x}/unique_id")
}

pub fn encode(id: &[u8; ID_BYTES]) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend_from_slice(id);
    v
}

pub fn decode(v: &[u8]) -> Result<[u8; ID_BYTES]> {
    if v.len() != MAGIC.len() + ID_BYTES || &v[..MAGIC.len()] != MAGIC {
        return Err(CommError::Protocol(format!(
            "the NCCL unique id in the store is malformed ({} bytes; expected {} starting with {:?})",
            v.len(),
            MAGIC.len() + ID_BYTES,
            String::from_utf8_lossy(MAGIC)
        )));
    }
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(&v[MAGIC.len()..]);
    Ok(id)
}

/// Rank 0 makes the id with `make` and publishes it under `key`; the other
/// ranks read it, waiting until `deadline`.
pub fn share(
    store: &StoreClient,
    key: &str,
    rank: usize,
    deadline: Instant,
    make: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    if rank == 0 {
        let id = make()?;
        store.set(key, &encode(&id))?;
        return Ok(id);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    store.wait(&[key], left).map_err(|e| match e {
        CommError::Timeout(m) => CommError::Timeout(format!(
            "rank {rank}: rank 0 did not publish the NCCL unique id ({m}); did it start with \
             PHALANX_BACKEND=nccl?"
        )),
        e => e,
    })?;
    decode(&store.get(key)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;
    use std::time::Duration;

    #[test]
    fn encoding_round_trips_and_refuses_garbage() {
        let mut id = [0u8; ID_BYTES];
        id.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 ^ 0x5a);
        assert_eq!(decode(&encode(&id)).unwrap(), id);
        assert!(decode(&id).is_err(), "no magic");
        assert!(decode(&encode(&id)[..100]).is_err(), "short");
        assert_eq!(
            key("phalanx/0", 1),
            "phalanx/0/nccl/0000000000000001/unique_id"
        );
    }

    #[test]
    fn a_fake_id_travels_through_the_store() {
        let secret = crate::wire::random_bytes(32);
        let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
        let addr = server.addr().to_string();
        let k = key("phalanx/test", 7);
        let fake = [0xabu8; ID_BYTES];
        let deadline = Instant::now() + Duration::from_secs(20);
        let readers: Vec<_> = (1..3)
            .map(|rank| {
                let (addr, secret, k) = (addr.clone(), secret.clone(), k.clone());
                std::thread::spawn(move || {
                    let s = StoreClient::connect(&addr, &secret, Duration::from_secs(10)).unwrap();
                    share(&s, &k, rank, deadline, || {
                        unreachable!("only rank 0 makes the id")
                    })
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let s0 = StoreClient::connect(&addr, &secret, Duration::from_secs(10)).unwrap();
        assert_eq!(share(&s0, &k, 0, deadline, || Ok(fake)).unwrap(), fake);
        for r in readers {
            assert_eq!(r.join().unwrap().unwrap(), fake);
        }
    }

    #[test]
    fn a_missing_id_times_out_naming_the_rank() {
        let secret = crate::wire::random_bytes(32);
        let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
        let s = StoreClient::connect(&server.addr().to_string(), &secret, Duration::from_secs(10))
            .unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        let e = share(&s, &key("p", 1), 3, deadline, || unreachable!()).unwrap_err();
        assert!(matches!(e, CommError::Timeout(_)), "{e}");
        assert!(e.to_string().contains("rank 3"), "{e}");
    }
}
