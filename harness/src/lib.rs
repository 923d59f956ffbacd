pub mod client;
pub mod gateway;
pub mod pg;
pub mod world;
